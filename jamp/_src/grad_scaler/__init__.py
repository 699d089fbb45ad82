"""``jamp.GradScaler``: which step recorded each inf check (``records``), the state and the
misuse machinery (``state``), and the PyTorch API (``scaler``)."""
