"""``jamp.autocast``: the rule table (``rules``), values and casts (``values``), float32
gradient sums (``sums``), what the backward pass keeps (``residuals``), the promote flow
(``flow``), the plan of a jaxpr (``plan``), one handler per rule (``handlers``), the
sub-computations (``higher_order``), the interpreter (``interpreter``), float8 products
(``float8``), the transformation (``transform``) and the public functions (``float8_api``,
``report``, ``api``). ``README.md`` explains how they fit."""
