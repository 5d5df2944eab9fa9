"""A stand-in for sgl_kernel, so that the real SGLang 0.5.23 server starts on this CPU.

SGLang's CPU path imports a CPU build of sgl_kernel when its modules load
(srt/mem_cache/allocation.py L45-46, kernels/ops/kvcache/cache_move.py L9-10, the speculative
decoding ops under kernels/ops/speculative/). The registry has only CUDA builds of that
package (sglang-kernel), so scripts/setup_sglang.sh uninstalls it and puts this directory on
the SGLang environment's path. These nine names serve speculative decoding, hierarchical
KV-cache moves and AMX paths, which a float32 dense model served without speculative decoding
on a CPU without AMX never calls: each raises if it is called. There is deliberately nothing
else (no module __getattr__, no torch.ops.sgl_kernel registrations), so that SGLang's checks
for CPU kernels see none and keep to plain torch (srt/utils/common.py cpu_has_amx_support).
"""


def _not_built(name: str):
  def missing(*args, **kwargs):
    raise NotImplementedError(
        f"sgl_kernel.{name} was called: longrl's stand-in (tests/sglang_cpu/sgl_kernel.py) has "
        "no CPU kernels; this SGLang configuration needs the real sgl_kernel")
  missing.__name__ = name
  return missing


assign_req_to_token_pool_cpu = _not_built("assign_req_to_token_pool_cpu")
copy_all_layer_kv_cache_cpu = _not_built("copy_all_layer_kv_cache_cpu")
assign_draft_cache_locs_contiguous_cpu = _not_built("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_built("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _not_built("build_tree_kernel_efficient_cpu")
fill_accept_out_cache_loc_cpu = _not_built("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_built("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _not_built("rotate_input_ids_cpu")
verify_tree_greedy_cpu = _not_built("verify_tree_greedy_cpu")
