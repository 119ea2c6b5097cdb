"""`pdserve trace`: reading span files into per-request timelines and plots. Tooling over shared.telemetry."""
