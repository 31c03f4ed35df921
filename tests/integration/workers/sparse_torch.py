"""Worker: trains a small model with two server-held tables (byteps_like.torch.SparseEmbedding
with SGD, SparseEmbeddingBag with Adagrad) and a dense head through DistributedOptimizer, then
checks every table row and the head against the same model trained in this one process with
nn.Embedding / nn.EmbeddingBag and torch's own optimizers on the mean of every worker's loss
(each worker's batch comes from (rank, step), so each can build the reference).
Prints ``OK rank R of N: tables and head match`` on success."""
import numpy as np
import torch

import byteps_like.torch as bps
from byteps_like.embedding import TableSpec, initial_rows
from byteps_like.errors import BytePSError

ROWS, BAG_ROWS, DIM, BATCH, STEPS = 2000, 500, 8, 32, 6
torch.manual_seed(0)
torch.set_num_threads(1)


def batch(rank: int, step: int):
    rng = np.random.default_rng([rank, step])
    ids = np.minimum(rng.zipf(1.4, BATCH), ROWS) - 1
    bag = rng.integers(0, BAG_ROWS, (BATCH, 3))
    y = rng.normal(size=(BATCH, 1)).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(bag), torch.from_numpy(y)


class Net(torch.nn.Module):
    def __init__(self, emb, bag):
        super().__init__()
        self.emb, self.bag = emb, bag
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, ids, bag):
        return self.head(torch.cat([self.emb(ids), self.bag(bag)], dim=1))


def main():
    bps.init()
    rank, size = bps.rank(), bps.size()
    emb = bps.SparseEmbedding(ROWS, DIM, name="emb", init="uniform", seed=1, lr=0.5)
    bag = bps.SparseEmbeddingBag(BAG_ROWS, DIM, mode="sum", name="bag", seed=2,
                                 optimizer="adagrad", lr=0.1)
    net = Net(emb, bag)
    assert [n for n, _ in net.named_parameters()] == ["head.weight", "head.bias"]
    head0 = {k: v.clone() for k, v in net.head.state_dict().items()}
    opt = bps.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.2),
                                   named_parameters=net.named_parameters())
    for step in range(STEPS):
        ids, bids, y = batch(rank, step)
        if step % 3 == 1:     # prefetched: both tables' pulls in flight, taken by the forward
            emb.prefetch(ids)
            bag.prefetch(bids)
        elif step % 3 == 2:   # prefetched with other ids: the forward pulls its own
            emb.prefetch(batch(rank, step + 100)[0])
        loss = torch.nn.functional.mse_loss(net(ids, bids), y)
        if step == 0:         # a step's forward before the last one's backward: refused
            try:
                emb.prefetch(ids)
            except BytePSError as exc:
                assert "before the previous one's backward" in str(exc), exc
            else:
                raise AssertionError("a prefetch before backward was accepted")
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()
    with torch.no_grad():
        got_emb = emb.table.pull(np.arange(ROWS))
        got_bag = bag.table.pull(np.arange(BAG_ROWS))

    # the reference: one process, dense tables, torch's optimizers, the mean of every loss
    e = torch.nn.Embedding(ROWS, DIM)
    b = torch.nn.EmbeddingBag(BAG_ROWS, DIM, mode="sum")
    with torch.no_grad():
        e.weight.copy_(torch.from_numpy(initial_rows(
            TableSpec.make("emb", ROWS, DIM, init="uniform", seed=1), np.arange(ROWS))))
        b.weight.copy_(torch.from_numpy(initial_rows(
            TableSpec.make("bag", BAG_ROWS, DIM, seed=2), np.arange(BAG_ROWS))))
    ref = Net(e, b)
    ref.head.load_state_dict(head0)
    opts = [torch.optim.SGD(e.parameters(), lr=0.5), torch.optim.Adagrad(b.parameters(), lr=0.1),
            torch.optim.SGD(ref.head.parameters(), lr=0.2)]
    for step in range(STEPS):
        loss = sum(torch.nn.functional.mse_loss(ref(*batch(r, step)[:2]), batch(r, step)[2])
                   for r in range(size)) / size
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    np.testing.assert_allclose(got_emb, e.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_bag, b.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    for name, p in net.head.state_dict().items():
        np.testing.assert_allclose(p.numpy(), ref.head.state_dict()[name].numpy(), rtol=1e-5,
                                   atol=1e-6)
    assert not np.array_equal(got_emb, initial_rows(
        TableSpec.make("emb", ROWS, DIM, init="uniform", seed=1), np.arange(ROWS)))
    print(f"OK rank {rank} of {size}: tables and head match", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
