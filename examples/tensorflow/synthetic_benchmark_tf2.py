"""Synthetic TensorFlow 2 benchmark in the style of BytePS's ``synthetic_benchmark_tf2.py``:
random images, a Keras model, ``bps.DistributedGradientTape`` in a ``tf.function`` step.

    bpslaunch --local --workers 2 --servers 1 -- \
        python examples/tensorflow/synthetic_benchmark_tf2.py --model mlp
    python examples/tensorflow/synthetic_benchmark_tf2.py --model ResNet50 --eager

``--model`` is ``mlp`` (a small fully connected net, the default, sized for CPU machines) or
any ``tf.keras.applications`` name (weights=None: no download). Prints, on rank 0, BytePS's
lines ``Img/sec per worker: X +-Y`` and ``Total img/sec on N worker(s): X +-Y``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import byteps_like.tensorflow as bps  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/: synthetic_loop
from synthetic_loop import timed_iters  # noqa: E402


def build_model(args):
    shape = (args.image_size, args.image_size, 3)
    if args.model == "mlp":
        layers = [tf.keras.Input(shape), tf.keras.layers.Flatten()]
        layers += [tf.keras.layers.Dense(args.mlp_hidden, activation="relu")
                   for _ in range(args.mlp_layers)]
        return tf.keras.Sequential(layers + [tf.keras.layers.Dense(args.num_classes)])
    return getattr(tf.keras.applications, args.model)(weights=None, input_shape=shape,
                                                      classes=args.num_classes)


def main() -> None:
    p = argparse.ArgumentParser(description="TensorFlow Synthetic Benchmark",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--fp16-pushpull", action="store_true", help="fp16 compression in push_pull")
    p.add_argument("--model", default="mlp", help="mlp or a tf.keras.applications model")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--mlp-hidden", type=int, default=1024)
    p.add_argument("--mlp-layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--eager", action="store_true", help="eager execution (no tf.function)")
    p.add_argument("--threads", type=int, default=0, help="TF intra/inter-op threads (0: TF's)")
    args = p.parse_args()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    bps.init()
    rank, size = bps.rank(), bps.size()
    model = build_model(args)
    opt = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = bps.Compression.fp16 if args.fp16_pushpull else bps.Compression.none
    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform([args.batch_size], minval=0, maxval=args.num_classes,
                               dtype=tf.int64)

    def benchmark_step(first_batch=False):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = bps.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step = benchmark_step if args.eager else tf.function(benchmark_step)
    bps.broadcast_variables(model.variables, root_rank=0)

    def log(s):
        if rank == 0:
            print(s, flush=True)

    nparams = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    log(f"Model: {args.model} ({nparams / 1e6:.2f} M parameters), batch size: "
        f"{args.batch_size}, workers: {size}, {'eager' if args.eager else 'tf.function'}")
    img_secs = timed_iters(step, args, log)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per worker: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {size} worker(s): {size * mean:.1f} +-{size * conf:.1f}")
    bps.shutdown()


if __name__ == "__main__":
    main()
