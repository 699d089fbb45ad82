"""Every model the benchmarks run, each defined once (the hub; ``benchmarks/README.md``).

One module by kind, every public name served here (``models.gpt_stack``): ``base`` (the
:class:`Model`, data, losses), ``plain`` (plain JAX), ``flax_modules``, ``torch_twins`` and
``real``. A :class:`Model` is float32 parameters (arrays, or shape structs for the GPU compile), a
batch and a loss; ``steps`` builds the training steps and precision variants from it.
Plain JAX: the loss-scaling MLP and GPT (:func:`mlp`, :func:`gpt`) and float8's MLP and
GPT stack, every product through an ``einsum`` hook the per-tensor reference replaces.
Flax modules at any ``dtype`` (:func:`flax_model`), the real models (:data:`REAL`), the
torch twins and the digits demo. The three GPTs are three models, not one written three
ways: each is the model recorded figures of ``RESULTS.md`` were measured on.
"""

from benchmarks.models.base import (  # noqa: F401
    BF16,
    DROPOUT_KEY,
    E4M3,
    E5M2,
    F32,
    ROOT,
    Model,
    images,
    mse,
    normal,
    sequences,
    xent,
)
from benchmarks.models.flax_modules import (  # noqa: F401
    CNN,
    Block,
    DropoutBlock,
    GPTStack,
    GQABlock,
    ResBlock,
    ResNet,
    cnn,
    dropout_block,
    flax_model,
    gpt_stack,
    gqa_block,
    resnet,
)
from benchmarks.models.plain import (  # noqa: F401
    ReferenceCNN,
    bf16_einsum,
    char_gpt,
    digits_demo,
    gpt,
    gpt_forward,
    gpt_params,
    layer_norm,
    load,
    mlp,
    mlp_forward,
    mlp_params,
    optimizer,
    reference_dot_general,
    reference_einsum,
)
from benchmarks.models.real import (  # noqa: F401
    DEBUG,
    REAL,
    Shapes,
    Skip,
    bert,
    digits_cnn,
    eqx_mlp,
    gemma,
    gpt2,
    gru_rnn,
    lm1b,
    nnx_builtins,
    wmt,
)
from benchmarks.models.torch_twins import (  # noqa: F401
    torch_cnn,
    torch_gpt,
    torch_mlp,
)
