"""``jamp.autocast``: the rule table (``rules``), values and casts (``values``), float32
gradient sums (``sums``), what the backward pass keeps (``residuals``), the dtype flow
(``flow``), the interpreter (``interpreter``), float8 products (``float8``) and the public
functions (``api``)."""
