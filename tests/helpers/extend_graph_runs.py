"""The engine's greedy tokens with extend passes eager and replayed from CUDA graphs, for the GPU tests that compare
them per model family (tests/runtime/test_extend_graphs.py, tests/models/test_deepseek_v2_parity.py)."""


def greedy_eager_and_graphed(model_path: str, prompts: list, reused_from: int, graph_tokens: int,
                             max_new_tokens: int, **engine_args) -> tuple[list, list]:
    """On CUDA, fp32: greedy tokens for `prompts`, then for prompts[reused_from:] again (their prefixes from the radix
    cache), once with --cuda-graph-max-extend-tokens 0 and once with graph_tokens.
    -> ([eager tokens, graphed tokens], [num_forward_extend_graphed of each run])."""
    from braid.runtime import Engine

    greedy = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    outputs, graphed = [], []
    for tokens in (0, graph_tokens):
        with Engine(model_path=model_path, log_level="warning", device="cuda", dtype="float32", max_total_tokens=4096,
                    cuda_graph_max_extend_tokens=tokens, **engine_args) as e:
            first = e.generate(input_ids=prompts, sampling_params=greedy)
            again = e.generate(input_ids=prompts[reused_from:], sampling_params=greedy)
            outputs.append([r["output_ids"] for r in first + again])
            graphed.append(e.scheduler.get_stats()["num_forward_extend_graphed"])
    return outputs, graphed
