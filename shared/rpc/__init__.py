"""gRPC stubs generated from proto/ (do not edit them: change the .proto and run `python -m shared.rpc.generate`)."""
