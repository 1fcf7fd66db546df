"""train.batch_anchors and the GPU memory model: the row slices' arithmetic (config.slice_size,
config.slice_rows), a micro-batch run as row slices gives the same gradients and stats as the whole
micro-batch (train_step.row_slices, train.accumulate), and flashdraft.memory's predictions (the peak's
growth and bound, FSDP against DDP, largest_batch_anchors, problems and the fit)."""

import dataclasses
import re
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from train_helpers import REPO

from flashdraft import memory
from flashdraft.config import (
    Config,
    DrafterConfig,
    TrainConfig,
    num_anchor_slots,
    rows_per_batch,
    slice_rows,
    slice_size,
    train_world,
)
from flashdraft.config_load import load
from flashdraft.estimate_inputs import target_shapes
from flashdraft.shapes import QWEN3_8B

pytestmark = pytest.mark.usefixtures("one_thread")

PRODUCTION = REPO / "config" / "production.yaml"
GIB = memory.GIB


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------------------
# config.slice_size and config.slice_rows


def check_slices(rows: int, slots: int, batch_anchors: int, per: int) -> None:
    """The properties of `per` = slice_size(rows, slots, batch_anchors)."""
    if not batch_anchors:
        assert per == rows
        return
    assert 1 <= per <= rows
    slices = ceil_div(rows, per)
    if slots <= batch_anchors:
        # within the bound, in the fewest slices the bound allows
        assert per * slots <= batch_anchors, (rows, slots, batch_anchors, per)
        assert slices == ceil_div(rows, batch_anchors // slots), (rows, slots, batch_anchors, per)
    else:  # not even one row fits the bound: one row a slice
        assert per == 1
    # as equal as can be: no smaller slice gives that many slices, and the last (padded) slice is not empty
    assert per == ceil_div(rows, slices)
    assert per == 1 or ceil_div(rows, per - 1) > slices
    assert rows - (slices - 1) * per >= 1
    assert slices * per - rows < slices  # the padding: less than one row per slice


@pytest.mark.parametrize("slots", [1, 3, 8, 16, 128, 512])
def test_slice_size_is_the_fewest_equal_slices_within_batch_anchors(slots):
    for rows in range(1, 41):
        for batch_anchors in [0, *range(1, 12 * slots + 2, max(1, slots // 4)), slots * rows, 10**9]:
            check_slices(rows, slots, batch_anchors, slice_size(rows, slots, batch_anchors))


@pytest.mark.parametrize("block_size", [7, 8, 16])
@pytest.mark.parametrize("max_anchors", [16, 100, 512])
def test_slice_rows_is_slice_size_of_the_bucket_s_micro_batch(block_size, max_anchors):
    for bucket in (64, 128, 1000, 1024, 3072):
        slots = num_anchor_slots(bucket, max_anchors, block_size)
        for batch_tokens in (bucket, 3 * bucket + 5, 16384, 50000):
            rows = rows_per_batch(bucket, batch_tokens)
            for batch_anchors in (0, 1, slots, 2 * slots, 2560, 5 * slots - 1, rows * slots, 10**7):
                cfg = TrainConfig(
                    buckets=[bucket],
                    batch_tokens=batch_tokens,
                    max_anchors=max_anchors,
                    batch_anchors=batch_anchors,
                )
                per = slice_rows(bucket, cfg, block_size)
                assert per == slice_size(rows, slots, batch_anchors)
                check_slices(rows, slots, batch_anchors, per)


# ---------------------------------------------------------------------------------------------------------
# train_step.row_slices: the same gradients and stats as the whole micro-batch

ROWS, BUCKET, MAX_ANCHORS = 5, 64, 16
DRAFTER = {"num_layers": 2, "block_size": 8}


@pytest.fixture(scope="module")
def toy_target(tmp_path_factory):
    from flashdraft.config import ToyConfig
    from flashdraft.toy import build_toy_target

    root = tmp_path_factory.mktemp("memory")
    build_toy_target(ToyConfig(steps=0, num_docs=200), str(root / "target"))
    return root / "target"


def tiny_step(target, family: str, loss: str, batch_anchors: int):
    """A float32 eager drafter of the toy target on the CPU, as training builds it (build_step)."""
    from flashdraft.train_step import build_step, load_spec

    drafter_cfg = DrafterConfig(family=family, **DRAFTER)
    cfg = TrainConfig(
        compile=False,
        attention="sdpa",
        max_anchors=MAX_ANCHORS,
        loss=loss,
        batch_anchors=batch_anchors,
        buckets=[BUCKET, 2 * BUCKET],
    )
    spec = load_spec(target, drafter_cfg)
    step = build_step(cfg, spec, target, torch.device("cpu"), drafter_cfg=drafter_cfg)
    assert step.batch_anchors == batch_anchors and step.amp_dtype is None
    return step


def micro_batch(step, bucket: int, rows: int, seed: int):
    """compile_cache.random_batch with prompts of several lengths (one row without any label) and its
    anchors: (batch, anchors, valid)."""
    from flashdraft.compile_cache import random_batch
    from flashdraft.config import needs_last_hidden
    from flashdraft.train_step import anchors_for

    spec = step.spec
    g = torch.Generator().manual_seed(seed)
    last = spec.hidden_size if needs_last_hidden(DrafterConfig(family=spec.family)) else 0
    batch = random_batch(
        bucket, rows, spec.num_features * spec.hidden_size, spec.vocab_size, torch.float32, g, last
    )
    for r in range(rows):
        batch["loss_mask"][r, : (7 * r + 3) % (bucket // 2)] = 0
    batch["loss_mask"][1] = 0  # a row with no anchor at all
    batch["loss_mask"][-1, bucket - bucket // 4 :] = 0  # padding at the end
    anchors, valid = anchors_for(step, batch["loss_mask"], g)
    return batch, anchors, valid


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("family, loss", [("dflash", "decay"), ("dflash", "dpace"), ("dspark", "decay")])
@pytest.mark.parametrize("batch_anchors", [2 * MAX_ANCHORS, 3 * MAX_ANCHORS + 5])
def test_row_slices_give_the_whole_micro_batch_s_gradients_and_stats(toy_target, family, loss, batch_anchors):
    from flashdraft.train_step import batch_normalizer, forward_backward, row_slices

    whole, sliced = (tiny_step(toy_target, family, loss, n) for n in (0, batch_anchors))
    for p, q in zip(whole.model.parameters(), sliced.model.parameters(), strict=True):
        assert p.equal(q)  # the same seeded drafter
    batch, anchors, valid = micro_batch(whole, BUCKET, ROWS, seed=1)
    rows, slots = anchors.shape
    assert (rows, slots) == (ROWS, num_anchor_slots(BUCKET, MAX_ANCHORS, DRAFTER["block_size"]))
    norm = batch_normalizer(whole, batch, anchors, valid).float()

    assert len(row_slices(whole, batch, anchors, valid)) == 1
    loss0, stats0 = forward_backward(whole, batch, anchors, valid, norm)
    expected = grads(whole.model)

    passes = row_slices(sliced, batch, anchors, valid)
    per = slice_size(rows, slots, batch_anchors)
    assert len(passes) == ceil_div(rows, per) >= 2 and rows % per  # several slices, the last one padded
    total, stats, tokens = 0.0, 0, 0
    for part, a, v in passes:
        assert a.shape == (per, slots) and v.shape == (per, slots)  # one shape for every slice
        assert a.numel() <= batch_anchors  # rows x slots of one forward+backward within the bound
        assert all(t.shape[0] == per for t in part.values() if isinstance(t, torch.Tensor))
        assert part["bucket"] == BUCKET
        loss, s = forward_backward(sliced, part, a, v, norm)
        total, stats, tokens = total + loss, stats + s, tokens + part["tokens"]
    # the padded rows hold no anchor
    _, a_last, v_last = passes[-1]
    pad = len(passes) * per - rows
    assert (a_last[per - pad :] == -1).all() and not v_last[per - pad :].any()
    assert valid.sum() == sum(v.sum() for _, _, v in passes)

    assert_same_grads(grads(sliced.model), expected)
    torch.testing.assert_close(total, loss0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats, stats0, rtol=1e-5, atol=1e-5)
    assert tokens == batch["tokens"]


def test_a_bound_at_or_above_the_micro_batch_runs_it_whole(toy_target):
    from flashdraft.train_step import row_slices

    step = tiny_step(toy_target, "dflash", "decay", 0)
    batch, anchors, valid = micro_batch(step, BUCKET, ROWS, seed=2)
    for n in (0, anchors.numel(), anchors.numel() + 1, 10**9):
        [(part, a, v)] = row_slices(dataclasses.replace(step, batch_anchors=n), batch, anchors, valid)
        assert part is batch and a is anchors and v is valid
    # one row's slots short of the whole: two slices
    n = anchors.numel() - anchors.shape[1]
    assert len(row_slices(dataclasses.replace(step, batch_anchors=n), batch, anchors, valid)) == 2


class Recorder:
    """What accumulate gives MetricsLogger.add: the summed stats and tokens."""

    def __init__(self):
        self.stats, self.tokens = 0, 0

    def add(self, stats, tokens):
        self.stats, self.tokens = self.stats + stats.double(), self.tokens + tokens


@pytest.mark.parametrize("loss", ["decay", "dpace"])
def test_accumulate_in_row_slices_is_the_unsliced_step(toy_target, loss):
    """The training loop's accumulate over two micro-batches of two buckets, with the global normalizer:
    the same gradients, stats and tokens with train.batch_anchors as without."""
    from flashdraft.train import accumulate
    from flashdraft.train_step import batch_normalizer

    got = {}
    for n in (0, 2 * MAX_ANCHORS):
        step = tiny_step(toy_target, "dflash", loss, n)
        micro = [micro_batch(step, BUCKET, ROWS, seed=3), micro_batch(step, 2 * BUCKET, 3, seed=4)]
        batches, anchors = [m[0] for m in micro], [m[1:] for m in micro]
        norm = sum(batch_normalizer(step, b, *av) for b, av in zip(batches, anchors, strict=True)).float()
        run = SimpleNamespace(step=step, cfg=SimpleNamespace(compile=False), sharded=False)
        metrics, seen = Recorder(), set()
        firsts = accumulate(run, batches, anchors, norm, metrics, seen)
        assert firsts == [BUCKET, 2 * BUCKET] and seen == {BUCKET, 2 * BUCKET}
        got[n] = grads(step.model), metrics
    (g0, m0), (g1, m1) = got.values()
    assert_same_grads(g1, g0)
    torch.testing.assert_close(m1.stats, m0.stats, rtol=1e-5, atol=1e-5)
    assert m1.tokens == m0.tokens == ROWS * BUCKET + 3 * 2 * BUCKET


# ---------------------------------------------------------------------------------------------------------
# flashdraft.memory


@pytest.fixture(scope="module")
def production():
    """production.yaml on Qwen3-8B's shapes (its target.path does not exist here)."""
    cfg = load(PRODUCTION, target=QWEN3_8B)
    return cfg, target_shapes(cfg, dict(QWEN3_8B))


def with_train(cfg: Config, **kw) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **kw))


def peak(cfg: Config, shapes: dict, world: int = 1, gpu: int | None = 80 * GIB, coefficients=None) -> int:
    return memory.train_peak(cfg, shapes, world, gpu, coefficients=coefficients).bytes


COEFS = [None, memory.PRIOR, {"draft": {"fp8": 1.5, "bf16": 2.0}, "context": 3.0, "constant": GIB}]


@pytest.mark.parametrize("coefficients", COEFS)
def test_train_peak_grows_with_batch_tokens_and_max_anchors(production, coefficients):
    """Never less with a larger train.batch_tokens or train.max_anchors (unbounded micro-batch), and more
    where every bucket holds more rows, or more anchor slots a row."""
    cfg, shapes = production
    cfg = with_train(cfg, batch_anchors=0)
    buckets, block = cfg.train.buckets, cfg.drafter.block_size

    sweep = [with_train(cfg, batch_tokens=t) for t in (1024, 3072, 4096, 8192, 16384, 32768, 65536, 2**20)]
    for a, b in pairwise(sweep):
        pa, pb = peak(a, shapes, coefficients=coefficients), peak(b, shapes, coefficients=coefficients)
        assert pb >= pa, (a.train.batch_tokens, b.train.batch_tokens)
        if all(
            rows_per_batch(s, b.train.batch_tokens) > rows_per_batch(s, a.train.batch_tokens) for s in buckets
        ):
            assert pb > pa, (a.train.batch_tokens, b.train.batch_tokens)
    assert peak(sweep[-1], shapes, coefficients=coefficients) > peak(
        sweep[0], shapes, coefficients=coefficients
    )

    sweep = [with_train(cfg, max_anchors=n) for n in (8, 64, 128, 200, 512, 1024, 4096)]
    for a, b in pairwise(sweep):
        pa, pb = peak(a, shapes, coefficients=coefficients), peak(b, shapes, coefficients=coefficients)
        assert pb >= pa, (a.train.max_anchors, b.train.max_anchors)
        if all(
            num_anchor_slots(s, b.train.max_anchors, block) > num_anchor_slots(s, a.train.max_anchors, block)
            for s in buckets
        ):
            assert pb > pa, (a.train.max_anchors, b.train.max_anchors)
    assert peak(sweep[-1], shapes, coefficients=coefficients) > peak(
        sweep[0], shapes, coefficients=coefficients
    )


@pytest.mark.parametrize("coefficients", COEFS)
@pytest.mark.parametrize("rows", [1, 2, 5, 7])
def test_batch_anchors_bounds_the_peak_whatever_the_micro_batch(production, coefficients, rows):
    """With train.batch_anchors = rows x slots, no micro-batch (however large train.batch_tokens) peaks
    above the one whose buckets each hold `rows` rows unbounded."""
    cfg, shapes = production
    slots = num_anchor_slots(max(cfg.train.buckets), cfg.train.max_anchors, cfg.drafter.block_size)
    assert {num_anchor_slots(b, cfg.train.max_anchors, 16) for b in cfg.train.buckets} == {slots}
    bound = max(
        peak(
            Config(
                drafter=cfg.drafter,
                train=dataclasses.replace(cfg.train, buckets=[b], batch_tokens=rows * b, batch_anchors=0),
            ),
            shapes,
            coefficients=coefficients,
        )
        for b in cfg.train.buckets
    )
    for tokens in (4096, rows * 3072, 16384, 49152, 10**5, 2**20, 2**24):
        bounded = with_train(cfg, batch_tokens=tokens, batch_anchors=rows * slots)
        assert peak(bounded, shapes, coefficients=coefficients) <= bound, tokens
        unbounded = with_train(cfg, batch_tokens=tokens, batch_anchors=0)
        assert peak(bounded, shapes, coefficients=coefficients) <= peak(
            unbounded, shapes, coefficients=coefficients
        )
    huge = with_train(cfg, batch_tokens=2**24, batch_anchors=0)
    assert peak(huge, shapes, coefficients=coefficients) > bound


@pytest.mark.parametrize("family", ["dflash", "dspark"])
@pytest.mark.parametrize("layers", [1, 5])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_fsdp_holds_less_state_per_gpu_than_ddp(production, family, layers, world):
    cfg, shapes = production
    cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, family=family, num_layers=layers))
    fsdp, ddp, single = (
        sum(memory.train_state(cfg, shapes, world, m).values()) for m in ("fsdp", "ddp", "single")
    )
    assert fsdp < ddp and single < ddp
    # and the predicted peak with it: the batch and the activations are the same
    peaks = {
        m: memory.train_peak(
            dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, parallel=m)),
            shapes,
            world,
            80 * GIB,
        )
        for m in ("fsdp", "ddp")
    }
    assert peaks["fsdp"].bytes < peaks["ddp"].bytes
    assert "fsdp" in peaks["fsdp"].note and "ddp" in peaks["ddp"].note
    # FSDP's sharded state shrinks with the process count
    assert sum(memory.train_state(cfg, shapes, 2 * world, "fsdp").values()) < fsdp
    # one process: no parallel mode, whatever train.parallel says
    one = {peak(with_train(cfg, parallel=m), shapes, world=1) for m in ("fsdp", "ddp", "auto")}
    assert len(one) == 1


@pytest.mark.parametrize("world", [1, 3, 8])
@pytest.mark.parametrize("gib", [12, 24, 32, 40, 48, 64, 80, 141, 1000])
def test_largest_batch_anchors_is_the_last_that_fits(production, world, gib):
    cfg, shapes = production
    gpu = gib * GIB
    t, b = cfg.train, cfg.drafter.block_size
    slots = max(num_anchor_slots(s, t.max_anchors, b) for s in t.buckets)
    most = max(rows_per_batch(s, t.batch_tokens) * num_anchor_slots(s, t.max_anchors, b) for s in t.buckets)
    n = memory.largest_batch_anchors(cfg, shapes, world, gpu)

    def fits(anchors):
        return peak(with_train(cfg, batch_anchors=anchors), shapes, world, gpu) <= memory.budget(gpu)

    if n is None:
        assert not fits(slots)  # not even one row
        return
    assert n % slots == 0 and fits(n)
    if n < most:
        assert not fits(n + slots)
    else:  # everything fits: the micro-batch runs whole
        assert peak(with_train(cfg, batch_anchors=n), shapes, world, gpu) == peak(
            with_train(cfg, batch_anchors=0), shapes, world, gpu
        )


def test_largest_batch_anchors_covers_every_case(production):
    """Each outcome: nothing fits (the state alone is too much), a bound (a card between one row's peak and
    the whole micro-batch's, whatever the coefficients read), everything fits."""
    cfg, shapes = production
    slots = num_anchor_slots(max(cfg.train.buckets), cfg.train.max_anchors, cfg.drafter.block_size)
    most = max(
        rows_per_batch(s, cfg.train.batch_tokens) * num_anchor_slots(s, cfg.train.max_anchors, 16)
        for s in cfg.train.buckets
    )
    one_row, whole = (peak(with_train(cfg, batch_anchors=n), shapes, gpu=None) for n in (slots, 0))
    assert one_row < whole
    between = int(((one_row + whole) / 2 + memory.CUDA_CONTEXT) / memory.FIT_FRACTION)
    assert memory.largest_batch_anchors(cfg, shapes, 1, 12 * GIB) is None
    assert slots <= memory.largest_batch_anchors(cfg, shapes, 1, between) < most
    assert memory.largest_batch_anchors(cfg, shapes, 1, 1000 * GIB) >= most


def config_keys(line: str, cfg: Config) -> list[str]:
    """The section.key names in `line` that are keys of the config."""
    return [
        m.group(0)
        for m in re.finditer(r"\b([a-z_]+)\.([a-z_]+)\b", line)
        if dataclasses.is_dataclass(getattr(cfg, m.group(1), None))
        and any(f.name == m.group(2) for f in dataclasses.fields(getattr(cfg, m.group(1))))
    ]


def test_problems_is_empty_for_a_config_that_fits(production):
    cfg, shapes = production
    for world in (1, 3, 8):
        assert memory.problems(cfg, shapes, world, 1000 * GIB, "test") == []
        assert memory.problems(cfg, shapes, world, 80 * GIB, "test") == []


@pytest.mark.parametrize("gib", [8, 16, 24])
def test_problems_is_one_line_per_failing_stage_naming_it_and_a_key(production, gib):
    cfg, shapes = production
    gpu = gib * GIB
    failing = [
        p.stage
        for p in memory.stage_peaks(cfg, shapes, 1, gpu)
        if memory.on_gpu(cfg, p.stage) and not p.by_construction and p.bytes > memory.budget(gpu)
    ]
    lines = memory.problems(cfg, shapes, 1, gpu, "gpus.memory_gib")
    assert failing and ("train" in failing or gib > 16)  # the drafter's state alone takes 18 GiB
    assert len(lines) == len(failing)
    for stage, line in zip(failing, lines, strict=True):
        assert line.startswith(f"stage {stage}: "), line
        assert "\n" not in line and "gpus.memory_gib" in line
        assert [k for k in config_keys(line, cfg) if k != "gpus.memory_gib"], line
    train = lines[failing.index("train")]
    assert any(k.startswith("train.") for k in config_keys(train, cfg)), train


def test_check_reads_the_card_from_gpus_memory_gib_else_the_visible_gpu(production):
    cfg, shapes = production
    world = train_world(cfg.gpus)
    small = dataclasses.replace(cfg, gpus=dataclasses.replace(cfg.gpus, memory_gib=16))
    assert (
        memory.check(small, lambda: 1000 * GIB, target=dict(QWEN3_8B))
        == memory.problems(cfg, shapes, world, 16 * GIB, "gpus.memory_gib")
        != []
    )
    assert memory.check(cfg, lambda: 16 * GIB, target=dict(QWEN3_8B)) == memory.problems(
        cfg, shapes, world, 16 * GIB, "the visible GPU"
    )
    assert memory.check(cfg, lambda: None, target=dict(QWEN3_8B)) == []  # the card unknown
    assert memory.check(cfg, lambda: 1000 * GIB, target=dict(QWEN3_8B)) == []


def test_the_train_remedy_applied_fits(production):
    """Only training fails (a huge unbounded micro-batch): its line names train.batch_anchors' largest
    value that fits, and the config with it has no problem left."""
    cfg, shapes = production
    big = with_train(cfg, batch_tokens=2**20, batch_anchors=0)
    for world in (1, 3):
        [line] = memory.problems(big, shapes, world, 80 * GIB, "test")
        assert line.startswith("stage train: ")
        n = memory.largest_batch_anchors(big, shapes, world, 80 * GIB)
        assert f"set train.batch_anchors to {n} or less (now unbounded)" in line
        assert memory.problems(with_train(big, batch_anchors=n), shapes, world, 80 * GIB, "test") == []


def test_the_precompute_remedy_applied_fits(production):
    cfg, shapes = production
    big = dataclasses.replace(cfg, hidden=dataclasses.replace(cfg.hidden, batch_tokens=2**20))
    [line] = memory.problems(big, shapes, 1, 80 * GIB, "test")
    assert line.startswith("stage precompute: ")
    tokens = int(re.search(r"set hidden\.batch_tokens to (\d+) or less", line).group(1))
    assert cfg.hidden.max_length <= tokens < 2**20
    fixed = dataclasses.replace(cfg, hidden=dataclasses.replace(cfg.hidden, batch_tokens=tokens))
    assert memory.problems(fixed, shapes, 1, 80 * GIB, "test") == []


KNOWN = {
    "draft": {"fp8": 2.25, "bf16": 3.5, "eager": 5.75, "dspark-fp8": 4.125},
    "context": 6.5,
    "constant": 3 * GIB + 12345,
}
VARIANTS = {
    "fp8": ({}, {"fp8": "tensorwise"}),
    "bf16": ({}, {"fp8": None}),
    "eager": ({}, {"compile": False, "fp8": None}),
    "dspark-fp8": ({"family": "dspark", "block_size": 7}, {"fp8": "tensorwise"}),
}


def synthetic_samples(coefficients: dict, shapes: dict, variants=VARIANTS) -> list:
    """One single-bucket point per (variant, bucket, rows, max_anchors), as benchmarks/memory.py measures
    them, each `measured` the model's prediction under `coefficients`."""
    out = []
    for name, (drafter, train) in variants.items():
        for bucket in (1024, 2048, 3072):
            for rows in (1, 4):
                for max_anchors in (128, 512):
                    cfg = Config(
                        drafter=DrafterConfig(**{"num_layers": 5, "block_size": 16, **drafter}),
                        train=TrainConfig(
                            **{
                                "buckets": [bucket],
                                "batch_tokens": rows * bucket,
                                "max_anchors": max_anchors,
                                **train,
                            }
                        ),
                    )
                    assert memory.variant(cfg) == name
                    measured = memory.train_peak(cfg, shapes, coefficients=coefficients).bytes
                    out.append(memory.Sample(cfg, shapes, measured))
    return out


@pytest.mark.parametrize(
    "shapes",
    [
        QWEN3_8B,
        {
            **QWEN3_8B,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
        },
    ],
)
def test_fit_recovers_the_coefficients_the_samples_came_from(shapes):
    shapes = dict(shapes)
    got = memory.fit(synthetic_samples(KNOWN, shapes))
    assert got["draft"].keys() == KNOWN["draft"].keys()
    for name, value in KNOWN["draft"].items():
        assert got["draft"][name] == pytest.approx(value, abs=1e-4), name
    assert got["context"] == pytest.approx(KNOWN["context"], abs=1e-4)
    assert got["constant"] == pytest.approx(KNOWN["constant"], rel=1e-6)
    # and its coefficients predict every sample again
    for s in synthetic_samples(KNOWN, shapes):
        predicted = memory.train_peak(s.cfg, s.shapes, coefficients=got).bytes
        assert predicted == pytest.approx(s.measured, rel=1e-6)


def test_a_variant_the_fit_lacks_is_predicted_at_its_family_s_largest():
    shapes = dict(QWEN3_8B)
    some = {k: VARIANTS[k] for k in ("fp8", "eager", "dspark-fp8")}
    got = memory.fit(synthetic_samples(KNOWN, shapes, some))
    assert set(got["draft"]) == set(some)
    assert memory.draft_coefficient(got, "bf16") == max(got["draft"].values())
    assert memory.draft_coefficient(got, "dspark-eager") == got["draft"]["dspark-fp8"]
    assert memory.draft_coefficient(got, "eager") == got["draft"]["eager"]
