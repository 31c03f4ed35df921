"""The digits MLP of train_digits.py as an elastic job: workers may be lost and join while it
trains (docs/elastic.md; Horovod's ``hvd.elastic`` API with ``import byteps_like.torch as bps``).

    bpslaunch --local --elastic --workers 3 --min-workers 2 --max-workers 3 --servers 1 -- \\
        python examples/pytorch/train_digits_elastic.py
    python examples/pytorch/train_digits_elastic.py       # no launcher: one process

What makes it elastic, compared with train_digits.py:

1. The model, the optimizer, an :class:`ElasticSampler` and the counters (``epoch``, ``step``)
   live in a ``bps.elastic.TorchState``. The sampler splits the samples of the epoch not yet
   processed over the current workers: after a change, the rest of the epoch is re-split over
   the new set and no sample is trained twice or skipped.
2. The training function is decorated with ``@bps.elastic.run``. When a worker is lost (or one
   joins), the collective that notices it raises ``MembershipChangedError``; ``run`` restores the
   last commit, joins the new epoch, gives every worker rank 0's state and calls the function
   again, which goes on from ``state.epoch`` and what the sampler says is left.
3. ``state.commit()`` every ``--commit-every`` steps: what a loss rolls back to, and where a
   worker waiting to join is admitted.
4. A reset callback scales the learning rate to the new number of workers (linear scaling, as
   in train_digits.py); the sync then gives every worker (a joiner too) rank 0's value.

Rank 0 prints progress and, at the end,
``final test accuracy: 0.XXXX (N workers at the end, S steps, R resets)``.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import byteps_like.torch as bps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/: digits_data
sys.path.insert(0, str(Path(__file__).resolve().parent))   # digits_torch (Ray loads by path)
from digits_data import parser  # noqa: E402
from digits_torch import Net, accuracy, load_data  # noqa: E402


def main() -> None:
    ap = parser(__doc__, lr_help="per-worker learning rate (times the number of workers)")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--commit-every", type=int, default=5, help="steps between commits")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    bps.init()
    torch.set_num_threads(1)   # several workers share the machine; the model is tiny
    xtr, ytr, xte, yte = load_data(seed=0)
    train_set = torch.utils.data.TensorDataset(xtr, ytr)

    torch.manual_seed(args.seed + bps.rank())       # differs per rank: the sync fixes it
    model = Net(args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * bps.size(), momentum=args.momentum)
    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    sampler = bps.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size,
                                         sampler=sampler)
    state = bps.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0,
                                   step=0, resets=0)

    def on_reset():
        for group in opt.param_groups:
            group["lr"] = args.lr * bps.size()
        state.resets += 1
        if bps.rank() == 0:
            print(f"membership changed: {bps.size()} workers now, resuming at epoch "
                  f"{state.epoch + 1} step {state.step}, lr {args.lr * bps.size():g}",
                  flush=True)

    state.register_reset_callbacks([on_reset])
    t0 = time.perf_counter()

    @bps.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            total, batches = 0.0, 0
            for i, (x, y) in enumerate(loader):
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                state.sampler.record_batch(i, args.batch_size)
                state.step += 1
                total, batches = total + loss.item(), batches + 1
                if state.step % args.commit_every == 0:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
            if bps.rank() == 0:
                print(f"epoch {state.epoch:3d}/{args.epochs}  loss "
                      f"{total / max(batches, 1):.4f}  test accuracy "
                      f"{accuracy(model, xte, yte):.4f}  {bps.size()} workers  "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)

    train(state)

    # every worker must hold the same weights: compare with the average over workers
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    avg = bps.push_pull(flat.clone(), average=True, name="check.parameters")
    assert torch.allclose(avg, flat, atol=1e-5), "workers diverged"
    if bps.rank() == 0:
        print(f"final test accuracy: {accuracy(model, xte, yte):.4f} ({bps.size()} workers at "
              f"the end, {state.step} steps, {state.resets} resets)", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
