"""Framework adapters, imported as ``ckptrun.adapters.<name>``."""
