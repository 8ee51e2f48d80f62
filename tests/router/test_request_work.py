"""The work bound of one request (router/options.py): what it counts, and that by default one
prompt at any n and max_tokens always fits while several prompts at the largest n do not."""

from pdserve.engine.sampling_params import MAX_N, SamplingParams
from pdserve.router.options import ServerOptions, request_work


def test_one_prompt_at_any_n_fits_the_default_and_several_at_the_largest_do_not():
    limit = ServerOptions().request_token_limit(512)
    assert limit == MAX_N * 512
    for p in (1, 100, 511):
        for n in (1, MAX_N):
            for scored in (None, 5):
                params = SamplingParams(n=n, max_tokens=512 - p, prompt_logprobs=scored)
                assert request_work([[7] * p], [params]) <= limit
    two = SamplingParams(n=MAX_N, max_tokens=400)
    assert request_work([[7] * 100] * 2, [two] * 2) == 2 * 100 + 2 * MAX_N * 400 > limit
    assert ServerOptions(max_request_tokens=64).request_token_limit(512) == 64


def test_the_prompts_count_once_unless_their_log_probs_go_with_every_copy():
    plain, scored = SamplingParams(n=4, max_tokens=3), SamplingParams(n=4, max_tokens=3, prompt_logprobs=1)
    assert request_work([[1] * 50], [plain]) == 50 + 4 * 3
    assert request_work([[1] * 50], [scored]) == 50 * 4 + 4 * 3
