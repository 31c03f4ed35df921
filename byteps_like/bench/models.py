"""The models of ``python -m byteps_like.bench train``: built from torch.nn constructors (and
torchvision's, for ResNet-50 and VGG-16), randomly initialised, nothing downloaded; each with a
synthetic batch (fixed seed), its default batch size per worker and its loss.

=============  =====================================================  =========  ===============
name           what                                                   batch      input
=============  =====================================================  =========  ===============
``resnet50``   torchvision ``resnet50(weights=None)``, 1000 classes     128      3x224x224
``vgg16``      torchvision ``vgg16(weights=None)``, 1000 classes        128      3x224x224
``bert``       BERT-large-shaped encoder (below), masked-LM loss         32      128 tokens
``tiny-bert``  the same at 4 layers x 256 (4 heads, FFN 1024)            16      128 tokens
``convnet``    16 conv3x3-BatchNorm-ReLU blocks, 10 classes (~2 M)       64      3x32x32
``mlp``        8 Linear-LayerNorm-GELU blocks, 10 classes (~2.3 M)       64      784
=============  =====================================================  =========  ===============

The BERT encoder: token embedding 30522 x H, position embedding 512 x H, embedding LayerNorm,
``nn.TransformerEncoderLayer(H, heads, 4H, batch_first=True, activation="gelu",
norm_first=True)`` per layer, a final LayerNorm, and BERT's masked-LM head (dense H x H, GELU,
LayerNorm, a decoder tied to the token embedding plus its own bias). The loss is the cross-entropy
over the vocabulary at 20 positions of each sequence (about 15% of 128, as BERT pre-training
masks): the whole encoder runs on every token, the 30522-way projection only where a token was
"masked". Pre-norm layers (with the final LayerNorm that pre-norm needs) rather than BERT's
post-norm: the parameter tensors and their shapes are the same, and pre-norm is what trains at
scale; the communication benchmarked depends only on the shapes.

This module imports torch only when a model is built (``--help`` works without it).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: masked positions per sequence of the BERT models' loss (about 15% of 128)
MASKED = 20
SEQ = 128


@dataclass(frozen=True)
class ModelInfo:
    """What the driver knows about a model without importing torch."""
    name: str
    batch: int              # default batch size per worker
    what: str               # one line for the report
    needs: str = ""         # a module that must be importable ("torchvision"), or ""
    lr: float = 0.01


MODELS: dict[str, ModelInfo] = {m.name: m for m in (
    ModelInfo("resnet50", 128, "torchvision ResNet-50 (weights=None), 3x224x224, 1000 classes",
              "torchvision"),
    ModelInfo("vgg16", 128, "torchvision VGG-16 (weights=None), 3x224x224, 1000 classes",
              "torchvision"),
    ModelInfo("bert", 32, "BERT-large-shaped encoder, 24 x 1024, seq 128, masked-LM loss",
              lr=1e-4),
    ModelInfo("tiny-bert", 16, "BERT-shaped encoder, 4 x 256, seq 128, masked-LM loss", lr=1e-3),
    ModelInfo("convnet", 64, "16 conv3x3-BatchNorm-ReLU blocks, 3x32x32, 10 classes"),
    ModelInfo("mlp", 64, "8 Linear-LayerNorm-GELU blocks of 512, 784 inputs, 10 classes"),
)}


def unavailable(name: str) -> str | None:
    """Why model ``name`` cannot be built here (None: it can)."""
    info = MODELS.get(name)
    if info is None:
        return f"unknown model {name!r} (choose from {', '.join(MODELS)})"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if info.needs and importlib.util.find_spec(info.needs) is None:
        return (f"model {name!r} needs {info.needs}, which is not installed here "
                f"(pip install {info.needs}); the models that need nothing else: "
                + ", ".join(m.name for m in MODELS.values() if not m.needs))
    return None


@dataclass
class Workload:
    """A built model on its device, one synthetic batch, and how to get its loss."""
    name: str
    model: Any                               # torch.nn.Module
    batch: tuple                             # tensors on the device
    loss: Callable[[Any, tuple], Any]        # (model, batch) -> scalar loss
    batch_size: int
    lr: float


# ------------------------------------------------------------------------------------ builders
def _bert(vocab: int, hidden: int, layers: int, heads: int, ffn: int, max_pos: int = 512):
    import torch
    from torch import nn

    class BertLike(nn.Module):
        """BERT's shapes from torch.nn parts; ``forward(ids, masked_positions)`` returns the
        vocabulary logits at the masked positions, (batch, masked, vocab)."""

        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, hidden)
            self.pos = nn.Embedding(max_pos, hidden)
            self.emb_norm = nn.LayerNorm(hidden)
            self.drop = nn.Dropout(0.1)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
                for _ in range(layers))
            self.norm = nn.LayerNorm(hidden)
            self.head_dense = nn.Linear(hidden, hidden)
            self.head_norm = nn.LayerNorm(hidden)
            self.decoder_bias = nn.Parameter(torch.zeros(vocab))
            for emb in (self.tok, self.pos):   # BERT's initialisation of the embeddings
                nn.init.normal_(emb.weight, std=0.02)

        def forward(self, ids, masked):
            positions = torch.arange(ids.shape[1], device=ids.device)
            x = self.drop(self.emb_norm(self.tok(ids) + self.pos(positions)))
            for layer in self.layers:
                x = layer(x)
            x = self.norm(x)
            h = x.gather(1, masked.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
            h = self.head_norm(nn.functional.gelu(self.head_dense(h)))
            return h @ self.tok.weight.t() + self.decoder_bias   # tied decoder

    return BertLike()


def _convnet(classes: int = 10, widths: tuple[int, ...] = (16, 32, 64, 256), blocks: int = 4):
    from torch import nn
    layers: list[nn.Module] = []
    cin = 3
    for stage, cout in enumerate(widths):
        for b in range(blocks):
            stride = 2 if stage > 0 and b == 0 else 1
            layers += [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                       nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def _mlp(inputs: int = 784, width: int = 512, blocks: int = 8, classes: int = 10):
    from torch import nn
    layers: list[nn.Module] = []
    cin = inputs
    for _ in range(blocks):
        layers += [nn.Linear(cin, width), nn.LayerNorm(width), nn.GELU()]
        cin = width
    layers.append(nn.Linear(cin, classes))
    return nn.Sequential(*layers)


def _torchvision(name: str):
    try:
        import torchvision
    except ImportError as exc:
        raise RuntimeError(f"model {name!r} needs torchvision (pip install torchvision): "
                           f"{exc}") from None
    return getattr(torchvision.models, name)(weights=None)


def build(name: str, device: Any, batch_size: int | None = None, seed: int = 0) -> Workload:
    """Model ``name`` on ``device`` (a torch.device) with its synthetic batch of ``batch_size``
    samples (default: the model's), drawn from a generator seeded with ``seed``. The model's
    initial weights come from torch's global generator seeded with 0, so every process builds
    the same model (the benchmark broadcasts them anyway)."""
    import torch
    from torch import nn
    why = unavailable(name)
    if why:
        raise RuntimeError(why)
    info = MODELS[name]
    bs = batch_size or info.batch
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(seed)
    ce = nn.functional.cross_entropy

    def classes(n: int) -> Any:
        return torch.randint(0, n, (bs,), generator=gen)

    batch: tuple[Any, ...]

    if name in ("resnet50", "vgg16"):
        model = _torchvision(name)
        batch = (torch.randn(bs, 3, 224, 224, generator=gen), classes(1000))
        loss = lambda m, b: ce(m(b[0]), b[1])
    elif name in ("bert", "tiny-bert"):
        vocab = 30522
        if name == "bert":
            model = _bert(vocab, 1024, 24, 16, 4096)
        else:
            model = _bert(vocab, 256, 4, 4, 1024)
        ids = torch.randint(0, vocab, (bs, SEQ), generator=gen)
        masked = torch.stack([torch.randperm(SEQ, generator=gen)[:MASKED] for _ in range(bs)])
        labels = torch.randint(0, vocab, (bs, MASKED), generator=gen)
        batch = (ids, masked, labels)
        loss = lambda m, b: ce(m(b[0], b[1]).flatten(0, 1), b[2].flatten())
    elif name == "convnet":
        model = _convnet()
        batch = (torch.randn(bs, 3, 32, 32, generator=gen), classes(10))
        loss = lambda m, b: ce(m(b[0]), b[1])
    else:
        model = _mlp()
        batch = (torch.randn(bs, 784, generator=gen), classes(10))
        loss = lambda m, b: ce(m(b[0]), b[1])
    model = model.to(device)
    model.train()
    return Workload(name, model, tuple(t.to(device) for t in batch), loss, bs, info.lr)


def gradient_info(model: Any) -> tuple[int, int]:
    """(number of gradient tensors, their bytes) of the trainable parameters."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return len(ps), sum(p.numel() * p.element_size() for p in ps)
