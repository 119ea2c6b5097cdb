#!/bin/sh
# One-shot `model-init` service: make sure the checkpoint that PDSERVE_MODEL names is in the models volume.
#   - a directory with config.json there: nothing to do;
#   - the demo path (/models/demo, the default) and missing: write the random-weight demo checkpoint
#     (arguments go to `pdserve demo-model`, e.g. --arch qwen3_moe --size tiny), atomically;
#   - anything else missing: fail with a message saying how to provide it.
set -eu
demo=/models/demo
model="${PDSERVE_MODEL:-$demo}"

if [ -f "$model/config.json" ]; then
    echo "model-init: using the checkpoint in $model"
    exit 0
fi
if [ "$model" != "$demo" ]; then
    echo "model-init: no checkpoint at $model (PDSERVE_MODEL): put a Hugging Face checkpoint directory" >&2
    echo "model-init: there (see README, Docker), or unset PDSERVE_MODEL to serve the demo model" >&2
    exit 1
fi
tmp="$demo.partial"
rm -rf "$tmp"
pdserve demo-model "$tmp" "$@"
rm -rf "$demo"  # a leftover without config.json is not a checkpoint
mv "$tmp" "$demo"
echo "model-init: wrote the demo checkpoint (random weights: its text is meaningless) to $demo"
