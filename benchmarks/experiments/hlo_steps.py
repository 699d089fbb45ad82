"""HLO statistics of each step variant (python -m benchmarks.experiments.hlo_steps MLP [dump])."""

import sys

from benchmarks import hlo, models, steps

m = {"MLP": models.mlp, "GPT": models.gpt}[sys.argv[1]]()
for donate in (True, False):
    for name, b in steps.VARIANTS.items():
        s, f = b(m)
        j, leaves = steps.make_flat_jit(f, s, donate=donate)
        c = j.lower(leaves, m.batch).compile()
        st = hlo.stats(c)
        print(f"donate={donate!s:5} {name:40s} " + " ".join(f"{k}={v:.4g}" for k, v in st.items()))
        if len(sys.argv) > 2 and donate:
            open(f"/tmp/hlo_{m.name}_{name.split()[0]}.txt", "w").write(c.as_text())
