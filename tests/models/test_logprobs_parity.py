"""Prompt and output logprobs agree with HF transformers' log-softmax."""

import torch

from braid.runtime import Engine


def test_prompt_and_output_logprobs_match_hf(hf_smollm2, smollm2_tok):
    prompt = "The quick brown fox jumps over the lazy dog because"
    ids = smollm2_tok.encode(prompt)
    with Engine(model_path="smollm2", log_level="warning", max_total_tokens=2048) as engine:
        res = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 8}, return_logprob=True,
                              logprob_start_len=0, top_logprobs_num=5)
    meta = res["meta_info"]
    full = ids + res["output_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(hf_smollm2(torch.tensor([full])).logits[0].float(), -1)
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(ids) and inp[0][0] is None and inp[0][1] == ids[0]
    for pos in range(1, len(ids)):
        lp, tok = inp[pos]
        assert tok == ids[pos]
        assert abs(lp - logp[pos - 1, tok].item()) < 1e-3
        top = meta["input_top_logprobs"][pos]
        ref_v, ref_i = logp[pos - 1].topk(5)
        assert [t for _, t in top] == ref_i.tolist()
    out = meta["output_token_logprobs"]
    assert len(out) == 8
    for k, (lp, tok) in enumerate(out):
        row = logp[len(ids) + k - 1]
        assert tok == int(row.argmax())
        assert abs(lp - row[tok].item()) < 1e-3
        assert meta["output_top_logprobs"][k][0][1] == tok


def test_logprob_start_len_skips_prefix(smollm2_tok):
    prompt = "One two three four five six seven eight"
    n = len(smollm2_tok.encode(prompt))
    with Engine(model_path="smollm2", log_level="warning", max_total_tokens=2048) as engine:
        engine.generate(prompt, {"max_new_tokens": 0})  # now cached: start_len must still be honoured
        res = engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=3)
        assert res["output_ids"] == [] and res["meta_info"]["finish_reason"]["type"] == "length"
        lps = res["meta_info"]["input_token_logprobs"]
        assert len(lps) == n - 3 and all(lp is not None and lp <= 0 for lp, _ in lps)
        assert engine.get_stats()["kv_used_tokens"] == 0
