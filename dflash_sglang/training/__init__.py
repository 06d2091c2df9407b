"""DFlash drafter training: model, blocks, data, training loop and CLI."""
