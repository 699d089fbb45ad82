"""Implementation modules of jamp; the public names live in ``jamp``."""
