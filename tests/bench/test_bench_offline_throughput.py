"""bench_offline_throughput runs both systems on the same prompts and reports best/median over repeats."""

import torch

from braid.runtime.bench import bench_offline_throughput


def test_offline_throughput_against_hf_with_repeats(capsys):
    torch.set_num_threads(1)
    result = bench_offline_throughput.main(["--num-prompts", "3", "--output-len", "4", "--compare-hf", "--repeats", "2",
                                            "--max-total-tokens", "2048"])
    braid, hf = result["rows"]
    assert braid["system"] == "braid" and hf["system"] == "hf-transformers"
    for row in (braid, hf):
        assert row["output_tokens"] == 3 * 4  # ignore_eos / min_new_tokens: every prompt generates all 4
        assert len(row["all_seconds"]) == 2 and row["seconds"] == min(row["all_seconds"])
        assert row["median_seconds"] >= row["seconds"]
    assert braid["kv_used_after"] == 0
    assert abs(result["ratio_vs_hf"] - braid["output_tok_s"] / hf["output_tok_s"]) < 1e-9
    assert "best-of-2" in capsys.readouterr().out


def test_speculative_run_reports_the_mean_acceptance_length(capsys):
    result = bench_offline_throughput.main(["--num-prompts", "3", "--output-len", "32", "--max-total-tokens", "2048",
                                            "--speculative-algorithm", "NGRAM"])
    row = result["rows"][0]
    assert row["output_tokens"] == 3 * 32 and row["kv_used_after"] == 0
    assert row["spec_accept_length"] >= 1.0  # drafts were verified (0.0: none)
    assert f"mean acceptance length (NGRAM): {row['spec_accept_length']:.2f}" in capsys.readouterr().out
