"""Where adapters live on the device: per-layer banks, bulk writes into them, and banks under offload hooks."""
