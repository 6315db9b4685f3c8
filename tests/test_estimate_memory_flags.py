"""scripts/plan/estimate_memory.py's command line: each bad value is one line naming the flag the user
typed, exit code 2, before anything is built (in process: the refusals come before the estimate);
and --seq-len follows the model when not given."""
from __future__ import annotations

import pytest

from scripts.plan import estimate_memory

PRESETS = "gpt_124m, gpt_1b, gpt_8b, gpt_d128, gpt_d256, gpt_small, gpt_tiny, moe_16b, moe_1b, moe_d256, moe_small, moe_tiny"

# Before: "(known: )" for a path; parallel.simulate_rank; "trainer.seq_len=4096 exceeds
# model.max_seq_len=512", keys the user never typed; --dp-shard 1000000 ran for minutes.
BAD_FLAGS = [
    (["--model", "conf/model/gpt_tiny"],
     f"error: --model conf/model/gpt_tiny: no such preset (did you mean gpt_tiny? known: {PRESETS})"),
    (["--model", "gpt_tiny", "--rank", "9"],
     "error: --rank 9: the layout has 8 ranks (--dp-replicate 1 x --dp-shard 8 x --tp 1), numbered 0 to 7"),
    (["--model", "gpt_tiny", "--seq-len", "4096"], "error: --seq-len 4096: more than gpt_tiny's max_seq_len 512"),
    (["--model", "gpt_tiny", "--dp-shard", "-1"], "error: --dp-shard -1: must be at least 1"),
    (["--model", "gpt_tiny", "--dp-shard", "1000000"],
     "error: --dp-shard 1000000: FSDP2 shards every parameter by rows, and the widest of gpt_tiny (embed) has 50304 "
     "rows on a rank of this layout: shard ranks beyond 50304 would hold nothing; shard over at most 50304 ranks "
     "(replicate for more data parallelism)"),
    (["--model", "gpt_tiny", "--dp-shard", "1", "--dp-replicate", "1000000"],
     "error: --dp-replicate 1000000 x --dp-shard 1 x --tp 1: 1000000 ranks, more than the 131072 (2^17) a dry run "
     "takes: beyond the largest GPU clusters of today, and the dry run's work grows with every rank"),
    # a check of the trainer's config, its key named as the flag
    (["--model", "gpt_tiny", "--tp", "3"], "error: model.n_heads=4 is not divisible by --tp 3"),
]


@pytest.mark.parametrize("argv, said", BAD_FLAGS, ids=[" ".join(argv) for argv, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_naming_it_with_exit_2(capsys, argv, said):
    with pytest.raises(SystemExit) as done:
        estimate_memory.main(argv)
    assert done.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [said] and captured.out == ""


def test_the_sequence_length_follows_the_model_unless_given():
    def seq_len(argv: list[str]) -> int:
        args = estimate_memory.parse_args(argv)
        estimate_memory.check_flags(args)
        return args.seq_len

    assert seq_len(["--model", "gpt_tiny"]) == 512  # its max_seq_len, shorter than the default 4096
    assert seq_len(["--model", "gpt_8b"]) == 4096
    assert seq_len(["--model", "gpt_8b", "--seq-len", "8192"]) == 8192
