"""Float8 matrix products with per-tensor scaling, as pure functions: ``recipe`` (the
delayed-scaling recipe, its state and the state's checks), ``products`` (quantisation,
the products' ``custom_vjp``s and how they accumulate) and ``telemetry`` (what each
product made of its tensors, returned as a cotangent)."""
