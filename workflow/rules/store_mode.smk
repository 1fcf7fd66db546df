# Store mode's side of the mode interface (hidden.mode: store; its rules are in hidden.smk). The Snakefile
# includes one mode's functions, this file or stream_mode.smk, before that mode's rules. Each file defines
# the names below, which the rules after them (warmup, train, report) and the default target read without
# testing the mode.
#   hidden_kept()         the hidden-state files a finished run keeps (rule all asks for each)
#   hidden_made_from()    a file made from all of them: one of them gone while it is there was deleted by hand
#   hidden_targets()      the mode's other files that rule all asks for
#   hidden_manifests()    the shard manifests the warmup and the report read
#   warmup_shards()       the shards the warmup checks the drafter's feature width against
#   report_hidden_args()  the report's arguments on the hidden states
#   train_data()          the train job's inputs of hidden states, by name
#   train_data_args       params function: the train job's data arguments, from those inputs
#   hidden_notes()        what a run says at its start about the mode's files on disk, one line each

VERIFIED = f"{RESULTS}/hidden/verify.json"  # hidden_verify's result


def shard_files(ext="arrow"):
    return expand(f"{RESULTS}/hidden/shard-{{shard}}.{ext}", shard=shard_ids())


def hidden_kept():
    """The hidden shards and their manifests."""
    return shard_files("arrow") + shard_files("json")


def hidden_made_from():
    """The shards' verification."""
    return VERIFIED


def hidden_targets():
    return [VERIFIED]


def hidden_manifests():
    return shard_files("json")


def warmup_shards():
    return shard_files("arrow")


def report_hidden_args():
    """The shards' directory: their manifests give the hidden stage's tokens/s."""
    return ["--hidden-dir", f"{RESULTS}/hidden"]


def train_data():
    """The verified shards (the trainer splits the validation samples out of them)."""
    return {"arrows": shard_files("arrow"), "verified": VERIFIED}


def train_data_args(wildcards, input):
    """The shards."""
    return " ".join(shlex.quote(a) for a in input.arrows)


def hidden_notes():
    return []
