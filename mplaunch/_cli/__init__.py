"""The `mplaunch` command (`python -m mplaunch`): parsing (main), what it runs
(targets), what it says on failure (report), and torchrun's flags (torchrun)."""
