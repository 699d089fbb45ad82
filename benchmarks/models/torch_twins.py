"""The torch twins of the MLP, the GPT and the CNN (the loss-scaling and autocast-memory
benchmarks' PyTorch rows)."""

from __future__ import annotations

# --------------------------------------------------------------------- torch twins


def torch_mlp(sizes):
    """The MLP in torch (relu), for the loss-scaling benchmark's PyTorch rows."""
    import torch

    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def torch_gpt(d, heads, layers, b, t):
    """The GPT stack in torch: (blocks, forward() -> loss, inputs)."""
    import torch
    import torch.nn.functional as F
    from torch import nn as tnn

    class TBlock(tnn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = tnn.LayerNorm(d), tnn.LayerNorm(d)
            self.q, self.k, self.v, self.o = (tnn.Linear(d, d) for _ in range(4))
            self.fc, self.out = tnn.Linear(d, 4 * d), tnn.Linear(4 * d, d)

        def forward(self, x, mask):
            h = self.ln1(x)
            q, k, v = (m(h).view(b, t, heads, d // heads).transpose(1, 2)
                       for m in (self.q, self.k, self.v))  # fmt: skip
            a = (q / (d // heads) ** 0.5) @ k.transpose(-1, -2)
            a = torch.softmax(a.masked_fill(~mask, torch.finfo(a.dtype).min), dim=-1)
            x = x + self.o((a @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    torch.manual_seed(0)
    blocks = tnn.ModuleList(TBlock() for _ in range(layers))
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    x, y = torch.randn(b, t, d), torch.randn(b, t, d)

    def forward():
        h = x
        for blk in blocks:
            h = blk(h, mask)
        return ((h.float() - y) ** 2).mean()

    return blocks, forward, (x, y, mask)


def torch_cnn(feats, groups, b, size):
    """The CNN in torch: (model, forward() -> loss, inputs)."""
    import torch
    from torch import nn as tnn

    torch.manual_seed(0)
    layers, c = [], 3
    for i, f in enumerate(feats):
        layers += [tnn.Conv2d(c, f, 3, stride=1 if i == 0 else 2, padding=1),
                   tnn.GroupNorm(groups, f), tnn.ReLU()]  # fmt: skip
        c = f
    body, head = tnn.Sequential(*layers), tnn.Linear(c, 10)
    model = tnn.ModuleList([body, head])
    x, labels = torch.randn(b, 3, size, size), torch.randint(0, 10, (b,))

    def forward():
        logits = head(body(x).mean(dim=(2, 3)))
        return torch.nn.functional.cross_entropy(logits.float(), labels)

    return model, forward, (x, labels)
