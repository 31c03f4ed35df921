"""The PyTorch side the digits examples (train_digits.py, train_digits_elastic.py) share: the
data as tensors, the model and its test accuracy. Needs ``examples/`` on ``sys.path``
(digits_data)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from digits_data import load_data as _load_numpy


def load_data(seed: int):
    xtr, ytr, xte, yte = _load_numpy(seed)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte),
            torch.from_numpy(yte))


class Net(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


@torch.no_grad()
def accuracy(model, x, y) -> float:
    model.eval()
    acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc
