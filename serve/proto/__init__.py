"""Generated from protos/ by tools/gen_protos.sh; do not edit."""
