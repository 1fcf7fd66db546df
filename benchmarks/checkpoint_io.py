"""Training checkpoints: save and load of the drafter's full state (fp32 weights and AdamW's two moments),
as training did before (torch.save of the GPU tensors, torch.load onto the GPU) and as it does now
(flashdraft.checkpoint.Checkpointer: pinned host buffers kept by the process, safetensors files written
from them in the background and read in the background, the optimizer's tensors on to the GPU), side by
side in one process on the same state, which each load must give back bit for bit.

A stream-mode chunk job pays one load at its start and one save at its end; the saves inside a chunk
(train.checkpoint_every) hold training up only for their copy to the host. Keys:
- save_before_s: torch.save of the GPU tensors (what every save cost before);
- save_first_blocking_s / save_first_s: a first save that allocates its host buffers itself (one made
  before any optimizer step): until training goes on / until the files are written;
- reserve_s: that allocation alone, as training makes it in the background after its first step;
  save_reserved_blocking_s: the first save after it;
- in_chunk_save_blocking_s: a later save (buffers reused) until training goes on; save_after_s: until
  written (a chunk's last save, which the job waits for);
- load_before_s: torch.load onto the GPU and load_state_dict;
- read_s: the background read, the optimizer's tensors on to the GPU (a chunk job overlaps it with its
  start-up);
  load_after_s: what is left on the critical path, the copy into the model and optimizer.
Every load follows its save, so the files are in the page cache, as the next chunk job on the same node
finds them (`--cold` also reads with the page cache dropped, where the machine allows it).

Usage: python benchmarks/checkpoint_io.py --preset tiny|qwen3-8b [--repeats 2] [--cold] [--work DIR]
           [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import time_it, write_result  # noqa: E402
from shapes import PRESETS  # noqa: E402

from flashdraft.checkpoint import Checkpointer, start_reading  # noqa: E402
from flashdraft.config import DrafterConfig  # noqa: E402
from flashdraft.distributed import Dist  # noqa: E402
from flashdraft.model import DFlashDrafter, DrafterSpec  # noqa: E402


def timed(fn, device) -> float:
    """Seconds of one call of `fn`, between two device syncs: a save or load runs once a round."""
    return time_it(fn, warmup=0, repeats=1, device=device).median_s


def drafter_cfg(preset: dict) -> DrafterConfig:
    return DrafterConfig(**preset["drafter"], mask_token_id=preset["mask_token_id"])


def training_state(preset: dict, device):
    """The drafter and an AdamW that has taken one step (both moments filled), as training holds them."""
    spec = DrafterSpec.from_target(SimpleNamespace(**preset["target"]), None, drafter_cfg(preset))
    torch.manual_seed(0)
    with torch.device(device):
        drafter = DFlashDrafter(spec)
    optimizer = torch.optim.AdamW(
        drafter.parameters(), lr=1e-4, weight_decay=0.0, fused=device.type == "cuda"
    )
    for p in drafter.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return drafter, optimizer, scheduler


def drop_page_cache() -> bool:
    try:
        import os

        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def save_before(path: Path, drafter, optimizer, scheduler):
    """What training did before: torch.save of the live GPU tensors (each copied to pageable host memory)."""
    path.mkdir(parents=True)
    torch.save(drafter.state_dict(), path / "model.pt")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, path / "optim.pt")
    (path / "state.json").write_text(json.dumps({"step": 1}))


def load_before(path: Path, drafter, optimizer, scheduler, device):
    opt = torch.load(path / "optim.pt", map_location=device, weights_only=True)
    model = torch.load(path / "model.pt", map_location=device, weights_only=True)
    drafter.load_state_dict(model)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])


def read_whole(reading):
    """The background read to its end (the optimizer's tensors come after the weights)."""
    return reading.result().optim_tensors()


def reserve_whole(ckpt):
    """Checkpointer.reserve's background allocation of the host buffers, to its end."""
    return ckpt.reserve().result()


def resume_whole(ckpt, path, reading):
    """Checkpointer.resume and the optimizer state it leaves for the first step, loaded now."""
    ckpt.resume(path, reading)
    ckpt.load_optimizer()


def state_of(drafter, optimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in drafter.state_dict().values()] + [
        t.clone() for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)
    ]


def measure(preset: dict, work: Path, repeats: int, cold: bool, report) -> None:
    """`repeats` rounds of every save and load; `report(rows, nbytes)` after each (a run cut short keeps
    the rounds it finished)."""
    device = torch.device(preset["device"])
    drafter, optimizer, scheduler = training_state(preset, device)
    saved = state_of(drafter, optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in saved)
    rows = []
    for r in range(repeats):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        row = {"repeat": r}
        row["save_before_s"] = timed(
            lambda: save_before(work / "before", drafter, optimizer, scheduler), device
        )
        ckpt = Checkpointer(work / "after", Dist(device=device), drafter, optimizer, scheduler, False, keep=1)
        for step, name in enumerate(("first", "second"), 1):
            row[f"save_{name}_blocking_s"] = timed(partial(ckpt.save, {"step": step}), device)
            t = timed(ckpt.wait, device)
            row[f"save_{name}_s"] = row[f"save_{name}_blocking_s"] + t
        reserved = Checkpointer(
            work / "reserved", Dist(device=device), drafter, optimizer, scheduler, False, keep=1
        )
        row["reserve_s"] = timed(partial(reserve_whole, reserved), device)
        row["save_reserved_blocking_s"] = timed(partial(reserved.save, {"step": 1}), device)
        reserved.wait()
        row["in_chunk_save_blocking_s"] = row["save_second_blocking_s"]
        row["save_after_s"] = row["save_second_s"]
        path = work / "after" / "step-00000002"
        row["load_before_s"] = timed(
            lambda: load_before(work / "before", drafter, optimizer, scheduler, device), device
        )
        for variant in ("", "_cold") if cold else ("",):
            if variant and not drop_page_cache():
                row["cold"] = False
                break
            fresh = Checkpointer(
                work / "after", Dist(device=device), drafter, optimizer, scheduler, False, keep=1
            )
            reading = start_reading(path, device)
            row[f"read{variant}_s"] = timed(partial(read_whole, reading), device)
            row[f"load_after{variant}_s"] = timed(partial(resume_whole, fresh, path, reading), device)
            assert all(torch.equal(a, b) for a, b in zip(saved, state_of(drafter, optimizer), strict=True))
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        report(rows, nbytes)


def summarize(rows: list[dict], nbytes: int) -> dict:
    best = {k: min(r[k] for r in rows) for k in rows[0] if k.endswith("_s")}
    gb = nbytes / 1e9
    return {
        "bytes": nbytes,
        "runs": rows,
        "best_s": best,
        "save_speedup": best["save_before_s"] / best["save_after_s"],
        "in_chunk_save_blocking_s": best["in_chunk_save_blocking_s"],
        "in_chunk_save_speedup": best["save_before_s"] / best["in_chunk_save_blocking_s"],
        "load_speedup": best["load_before_s"] / best["load_after_s"],
        "stage_gb_per_s": gb / best["in_chunk_save_blocking_s"],
        "write_gb_per_s": gb / (best["save_after_s"] - best["in_chunk_save_blocking_s"]),
        "read_gb_per_s": gb / best["read_s"],
    }


def state_bytes(preset: dict) -> int:
    """Bytes of the drafter's fp32 weights, AdamW's two moments and its step counts, from the shapes."""
    spec = DrafterSpec.from_target(SimpleNamespace(**preset["target"]), None, drafter_cfg(preset))
    with torch.device("meta"):
        params = list(DFlashDrafter(spec).parameters())
    return sum(3 * p.numel() * 4 + 4 for p in params)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cold", action="store_true", help="also load with the page cache dropped (root only)")
    p.add_argument("--work", default=None, help="where the checkpoints are written (default: a temp dir)")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--from-log",
        default=None,
        metavar="LOG",
        help="summarize the rows a run printed (one cut short before writing its JSON)",
    )
    p.add_argument("--device", default=None, help="with --from-log: the device the run was made on")
    args = p.parse_args()
    preset = PRESETS[args.preset]
    out = Path(args.out or REPO / "benchmarks" / "results" / f"checkpoint_io_{args.preset}.json")
    head = {"what": __doc__.split("\n")[0], "preset": args.preset}
    if args.device:  # the rows' machine, not this one (`machine`)
        head["device"] = args.device

    def report(rows, nbytes):
        result = {**head, "repeats": f"{len(rows)} of {args.repeats}", **summarize(rows, nbytes)}
        return write_result(out, result, params=vars(args), device=preset["device"])

    if args.from_log:
        rows = [
            json.loads(line)
            for line in Path(args.from_log).read_text().splitlines()
            if line.startswith('{"repeat"')
        ]
        result = report(rows, state_bytes(preset))
    else:
        if preset["device"] == "cuda" and not torch.cuda.is_available():
            sys.exit(f"checkpoint_io: error: preset {args.preset} needs a GPU")
        work = Path(args.work or tempfile.mkdtemp(prefix="flashdraft-ckpt-bench-")) / "ckpt"
        # 12.6 GB a checkpoint at the production shape: the files go, also when a time limit ends the run
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            measure(preset, work, args.repeats, args.cold, report)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        result = json.loads(out.read_text())
    b = result["best_s"]
    print(
        f"{result['bytes'] / 1e9:.2f} GB: save {b['save_before_s']:.2f} s -> {b['save_after_s']:.2f} s "
        f"({result['save_speedup']:.2f}x; training waits {b['in_chunk_save_blocking_s']:.2f} s of it, the "
        f"first save {b['save_first_blocking_s']:.2f} s), load {b['load_before_s']:.2f} s -> "
        f"{b['load_after_s']:.2f} s after a {b['read_s']:.2f} s background read "
        f"({result['load_speedup']:.2f}x); {out}"
    )


if __name__ == "__main__":
    main()
