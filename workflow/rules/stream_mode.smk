# Stream mode's side of the mode interface (hidden.mode: stream; its rules are in stream.smk), and the
# helpers of its rules. The Snakefile includes one mode's functions, this file or store_mode.smk, before
# that mode's rules. Each file defines the names below, which the rules after them (warmup, train, report)
# and the default target read without testing the mode.
#   hidden_kept()         the hidden-state files a finished run keeps (rule all asks for each)
#   hidden_made_from()    a file made from all of them: one of them gone while it is there was deleted by hand
#   hidden_targets()      the mode's other files that rule all asks for
#   hidden_manifests()    the shard manifests the warmup and the report read
#   warmup_shards()       the shards the warmup checks the drafter's feature width against
#   report_hidden_args()  the report's arguments on the hidden states
#   train_data()          the train job's inputs of hidden states, by name
#   train_data_args       params function: the train job's data arguments, from those inputs
#   hidden_notes()        what a run says at its start about the mode's files on disk, one line each

from flashdraft.config import PLAN_TRAIN_KEYS, STREAM_RING, run_config_digest
from flashdraft.reruns import store_leftovers


PLAN = f"{RESULTS}/plan"  # the data plan (a checkpoint rule's directory)
CHUNKS = f"{RESULTS}/hidden/stream"  # a chunk's hidden parts: CHUNKS/epoch-EEE/chunk-CCCCC/part-PPPPP.arrow
CHUNK_RE = r"epoch-\d{3}/chunk-\d{5}"
VAL_SHARD = f"{RESULTS}/hidden/val.arrow"  # the validation samples (store mode splits its shards)
VAL_VERIFIED = f"{RESULTS}/hidden/val-verify.json"  # hidden_val_verify's result


def run_config():
    """Params function: a digest of what makes a training run of the train and drafter sections
    (flashdraft.config.run_config, which the run key hashes): the rerun trigger of the chunks."""
    digest = run_config_digest(CFG.train, CFG.drafter)
    return lambda wildcards: digest


def val_shard():
    """With train.val_samples: the validation shard and its verification, inputs of every chunk's
    training."""
    return {"val": VAL_SHARD, "val_verified": VAL_VERIFIED} if CFG.train.val_samples else {}


def tokens_files():
    """The tokenized hidden shards, in shard order (the samples' numbering)."""
    return [f"{RESULTS}/tokens/shard-{s}.parquet" for s in shard_ids()]


def planned_chunks():
    """The data plan's chunk names (epoch-EEE/chunk-CCCCC) in training order; known once the data_plan
    checkpoint has run."""
    plan = Path(checkpoints.data_plan.get().output[0]) / "plan.json"
    return [f"epoch-{c['epoch']:03d}/chunk-{c['chunk']:05d}" for c in json.loads(plan.read_text())["chunks"]]


def chunk_parts():
    """Hidden-state jobs per chunk: one per target GPU (one on the CPU)."""
    return max(1, CFG.gpus.target)


def chunk_part_files(ext):
    def f(wildcards):
        return [f"{CHUNKS}/{wildcards.chunk}/part-{p:05d}.{ext}" for p in range(chunk_parts())]

    return f


def chunk_done(name):
    return f"{RESULTS}/train/chunks/{name}.json"


def previous_chunk(wildcards):
    """A chunk trains from where the chunk before it ended."""
    chunks = planned_chunks()
    i = chunks.index(wildcards.chunk)
    return [chunk_done(chunks[i - 1])] if i else []


def ring_wait(wildcards):
    """A chunk's hidden parts wait for the training of the chunk STREAM_RING places before it, whose own
    parts are deleted then: no more than STREAM_RING chunks are on disk at once."""
    chunks = planned_chunks()
    i = chunks.index(wildcards.chunk)
    return [chunk_done(chunks[i - STREAM_RING])] if i >= STREAM_RING else []


def last_chunk(wildcards):
    return chunk_done(planned_chunks()[-1])


def hidden_kept():
    """The tokenized shards (the chunks' hidden states are temp())."""
    return tokens_files()


def hidden_made_from():
    """The data plan, made from every tokenized shard."""
    return f"{PLAN}/plan.json"


def hidden_targets():
    """None: the data plan and the chunks are the train job's inputs."""
    return []


def hidden_manifests():
    """None: no shard is kept, and a chunk's parts are made after the warmup."""
    return []


def warmup_shards():
    """None, as hidden_manifests."""
    return []


def report_hidden_args():
    """None: no shard manifest gives the hidden stage's tokens/s."""
    return []


def train_data():
    """Once the last chunk has trained (train_chunk), the train job exports the run's last checkpoint."""
    return {"last_chunk": last_chunk, "plan": PLAN}


def train_data_args(wildcards, input):
    """The data plan (the run's key and its chunks)."""
    return f"--plan {shlex.quote(input.plan)}"


def hidden_notes():
    """The store-mode shards of an earlier run, which nothing reads now."""
    line = store_leftovers(f"{RESULTS}/hidden")
    return [line] if line else []
