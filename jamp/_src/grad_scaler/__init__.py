"""``jamp.GradScaler``: which step recorded each inf check (``records``) and the scaler
itself (``scaler``)."""
