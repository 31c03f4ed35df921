"""Send a torch CUDA tensor between two UcxEndpoints and say what worked.

Run on a GPU machine: UCX_TLS=tcp,cuda_copy,cuda_ipc UCX_NET_DEVICES=lo python scripts/device_ucx_check.py
Without torch/CUDA or a CUDA-enabled UCX it reports why and exits 0 (a skip), or 1 on a failure.
"""
import os
import sys
import threading

os.environ.setdefault("UCX_TLS", "tcp,cuda_copy,cuda_ipc")
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def main() -> int:
    try:
        import torch
    except ImportError:
        print("SKIP: torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device visible")
        return 0
    from byteps_like.transport import Route
    from byteps_like.transport.ucx_transport import UcxEndpoint
    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    srv = UcxEndpoint("gpu-srv", ucx_env=env, device_memory=True)
    cli = UcxEndpoint("gpu-cli", ucx_env=env, device_memory=True)
    print(f"UCX CUDA support: {cli.cuda_support} ({env})")
    if not cli.cuda_support:
        print("FALLBACK: this UCX has no CUDA support; device tensors must be copied to host")
        srv.close(); cli.close()
        return 0
    got, done = [], threading.Event()
    srv.on_message = lambda route, frames: (got.append(frames), done.set())
    addr = srv.bind("ucx://127.0.0.1:0")
    srv.start(); cli.start()
    cli.connect("s", addr)
    x = torch.arange(1 << 22, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    try:
        cli.send(Route(peer="s"), [b"dev", x])
        ok = done.wait(30)
        if not ok:
            print("FAIL: the device frame did not arrive in 30 s")
            return 1
        host = torch.frombuffer(bytearray(got[0][1]), dtype=torch.float32)
        same = torch.equal(host, x.cpu())
        print(f"{'OK' if same else 'FAIL'}: sent {x.numel() * 4} bytes of device memory "
              f"directly; received into host staging; contents {'match' if same else 'differ'}")
        return 0 if same else 1
    finally:
        cli.close(); srv.close()


if __name__ == "__main__":
    sys.exit(main())
