"""The finite check and non-finite reports: ``check`` (``all_finite``, ``unscale_and_check``,
by one of two branches: ``default`` on GPUs and TPUs, ``cpu`` on CPUs) and ``report``
(which leaf overflowed)."""
