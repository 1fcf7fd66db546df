"""The lines a rerun prints at its start: deleted shards, a store run's leftovers, the costly outputs it
makes again."""

from flashdraft.reruns import deleted_line, deleted_shards, redo_lines, store_leftovers


def test_a_shard_is_deleted_only_once_what_was_made_from_it_is_there(tmp_path):
    shards = [tmp_path / f"shard-{i:05d}.arrow" for i in range(3)]
    shards[0].write_bytes(b"x")
    verified = tmp_path / "verify.json"
    assert deleted_shards(shards, verified) == []  # a fresh run: nothing made yet, nothing deleted
    verified.write_text("{}")
    assert deleted_shards(shards, verified) == shards[1:]
    assert deleted_line(["results/hidden/shard-00001.arrow"], "snakemake --cores all") == (
        "results/hidden/shard-00001.arrow: deleted since the run that used it; the plain run makes it again, "
        "with what depends on it (snakemake --cores all)"
    )
    assert deleted_line(["a", "b", "c"], "snakemake").startswith("a and 2 more: deleted")


def test_store_mode_shards_are_counted_and_sized_for_a_stream_run(tmp_path):
    hidden = tmp_path / "my results" / "hidden"
    (hidden / "stream").mkdir(parents=True)
    (hidden / "val.arrow").write_bytes(b"v" * 100)  # stream mode's own
    assert store_leftovers(hidden) is None
    for i in range(2):
        (hidden / f"shard-{i:05d}.arrow").write_bytes(b"x" * 1500)
        (hidden / f"shard-{i:05d}.json").write_bytes(b"{}")
    assert store_leftovers(hidden) == (
        f"{hidden} holds 2 store-mode hidden shard(s) (3 kB) that this stream-mode run does not read; to "
        f"free the space: rm '{hidden}'/shard-*"
    )


def test_redo_lines_name_only_costly_stages_whose_outputs_are_there():
    jobs = [
        ("hidden_shard", True, ["updated input files"]),
        ("hidden_shard", True, ["input files updated by another job", "updated input files"]),
        ("hidden_shard", False, ["output files have to be generated"]),  # a new shard: not a redo
        ("prompts", True, ["params have changed since last execution"]),  # cheap: not named
        ("train", True, ["input files updated by another job"]),
    ]
    assert redo_lines(jobs) == [
        "this run makes 2 finished hidden_shard output(s) again (updated input files; input files updated by "
        "another job); `snakemake -n` lists each job's reason before a run",
        "this run makes 1 finished train output(s) again (input files updated by another job); "
        "`snakemake -n` lists each job's reason before a run",
    ]
    assert redo_lines([("train", False, ["output files have to be generated"])]) == []
