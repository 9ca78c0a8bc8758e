"""The sync hand-off: from the learner starting to publish version v to a server admitted with v's weights.

    python bench/handoff.py [--model assets/tiny/actor] [--steps 60] [--train-ms 20]

In ``--mode sync`` every step pays this latency twice over nothing else: the learner publishes, announces
the version, and the server (blocked in ``wait_admission`` as rollout/loop.py blocks) wakes, loads the
weights and starts generating. Two ways of announcing, alternated step by step in the same run:
  separate  the shm publisher's announce transaction, then ``admission.set_version(v)`` (a second one);
  folded    ``admission.queue_version`` inside the publisher's announce transaction (what the learner does).
A real embedded Redis, the real ``ShmPublisher``/``ShmSubscriber`` and ``Admission``; the server is a
separate process. Prints the median hand-off and the learner's own publish time per variant and their
ratios; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":  # bench/buffer.py would shadow buffer/
    sys.path[0] = str(ROOT)

import redis  # noqa: E402
import torch  # noqa: E402

from buffer.admission import Admission  # noqa: E402
from buffer.redis_server import EmbeddedRedis  # noqa: E402
from weightsync.base import weights_key  # noqa: E402
from weightsync.shm import ShmPublisher, ShmSubscriber  # noqa: E402

RUN = "handoff"
DONE = "bench:handoff:done"  # the server pushes (version, perf_counter) here once admitted with v's weights


def server(url: str, steps: int) -> None:
    """What rollout/loop.py does between batches: wait for admission (taking weights meanwhile), then
    make sure it holds the learner's version."""
    client = redis.Redis.from_url(url, socket_timeout=30)
    adm = Admission(client, RUN, consumer="server-0", batch_size=1, max_staleness=0, n_samples=1)
    sub = ShmSubscriber(client, RUN, "server-0")
    held = [-1]

    def take_weights(timeout: float = 0.0) -> None:
        upd = sub.poll(timeout)
        if upd is not None:
            for _, t in upd.tensors():  # an engine copies the views into its parameters
                t.clone()
            held[0] = upd.version

    for _ in range(steps + 1):
        ok = adm.wait(
            1, timeout_s=30, while_waiting=take_weights, wake_channels=[weights_key(RUN, "announce")]
        )
        assert ok, "server: not admitted within 30 s"
        take_weights()
        while held[0] < (v := adm.version()):
            take_weights(1.0)
        client.rpush(DONE, json.dumps([v, time.perf_counter()]))
    sub.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="assets/tiny/actor")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--train-ms", type=float, default=20.0, help="the learner's 'training' between versions")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(ROOT / args.model, dtype=torch.float32)
    tensors = [(n, t.detach()) for n, t in model.state_dict().items()]
    mb = sum(t.nbytes for _, t in tensors) / 1e6
    with tempfile.TemporaryDirectory(prefix="tandem-handoff-") as tmp, EmbeddedRedis(tmp) as r:
        client = r.client(socket_timeout=30)
        adm = Admission(client, RUN, consumer="learner-0", batch_size=1, max_staleness=0, n_samples=1)
        pub = ShmPublisher(client, RUN, Path(tmp) / "weights")
        pub.publish(tensors, 0)
        adm.set_version(0)
        proc = mp.get_context("spawn").Process(target=server, args=(r.url, args.steps))
        proc.start()
        client.blpop(DONE, timeout=60)  # admitted at v0: the server is up
        times: dict[str, dict[str, list[float]]] = {
            v: {"handoff": [], "publish": []} for v in ("separate", "folded")
        }
        for step in range(1, args.steps + 1):
            variant = "folded" if step % 2 else "separate"
            time.sleep(args.train_ms / 1000)  # the server is blocked in wait_admission meanwhile
            t0 = time.perf_counter()
            pub.publish(tensors, step, announce=adm.queue_version if variant == "folded" else None)
            if variant == "separate":
                adm.set_version(step)
            t1 = time.perf_counter()
            got = client.blpop(DONE, timeout=60)
            assert got is not None, "server: no report within 60 s"
            v, t_ready = json.loads(got[1])
            assert v == step, (v, step)
            if step > 2:  # the first versions warm the mappings
                times[variant]["handoff"].append(t_ready - t0)
                times[variant]["publish"].append(t1 - t0)
        proc.join(30)
        pub.close()
    med = {v: {k: statistics.median(xs) * 1000 for k, xs in d.items()} for v, d in times.items()}
    print(f"[handoff] {args.model}: {mb:.2f} MB of weights, {args.steps} steps alternating, medians:")
    for v, d in med.items():
        print(f"  {v:9s} hand-off {d['handoff']:.2f} ms, learner publish+announce {d['publish']:.2f} ms")
    ratio = {k: round(med["folded"][k] / med["separate"][k], 3) for k in ("handoff", "publish")}
    print(f"  folded / separate: hand-off {ratio['handoff']:.2f}×, publish {ratio['publish']:.2f}×")
    out = {f"{v}_{k}_ms": round(x, 3) for v, d in med.items() for k, x in d.items()}
    print(
        json.dumps(
            {"model": args.model, "mb": round(mb, 2), **out, **{f"{k}_ratio": x for k, x in ratio.items()}}
        )
    )


if __name__ == "__main__":
    main()
