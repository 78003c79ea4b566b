"""A precompiled graph's call straight into the function inductor built for it, past AOTAutograd's runtime wrapper
where that wrapper has nothing to do.

A graph read back from its file (engine.worker.aot_graphs) runs as dynamo's bytecode, which gathers the model's
parameters and the forward's inputs into one argument list, then AOTAutograd's wrappers, then inductor's function.
For the forwards the engine compiles (inference, the KV cache written inside the graph and kept there as an in-place
write, every output a fresh tensor) the wrappers hand the list through and return inductor's outputs: on every graph
of the embedded pair, the same argument objects and the same output tensors. What they do besides is bump the
written cache tensors' version counters, which only autograd reads (nothing here differentiates), turn grad mode off
around the call (the runner forwards under inference mode already) and count the outputs. Skipping them saved a
median 0.04-0.12 ms a forward of the embedded target at the few-row layouts of a batch-1 step (of 5-13 ms) and
0.02-0.04 ms of the draft's (of 0.7-2.5 ms), three runs on 2 CPU cores, the logits the same bit for bit
(benchmarks/kernel_call.py): small, and paid by every forward.

A graph whose wrapper would do anything else (write mutated inputs back, rebuild an aliased output, thread
functionalised randomness or effect tokens, tensor subclasses, a backward) keeps torch's call, as does every graph of
a torch whose wrappers are laid out otherwise than 2.13's.
"""

from __future__ import annotations

from typing import Any


def call_kernel_directly(fn: Any) -> bool:
    """Points ``fn`` (a graph read back: dynamo's ``AOTCompiledFunction``) at inductor's compiled function instead of
    AOTAutograd's wrapper around it, where that wrapper only passes the call through (module docstring). True where
    it did; otherwise ``fn`` is left as it was."""
    try:
        from torch._functorch._aot_autograd.runtime_wrappers import mark_dynamo_propagated_dynamic_indices
        from torch._functorch._aot_autograd.schemas import PlainTensorMeta
        from torch._inductor.output_code import CompiledFxGraph

        scope = fn.fn.__globals__  # the bytecode's globals: the wrapper is the global its call names
        backend_id = fn._artifacts.backend_id
        entry = scope[backend_id].compiled_fn  # AOTAutograd's forward(*args): the list goes to its runtime wrapper
        wrapper = entry.compiled_fn
        graph = wrapper.__wrapped__  # what the runtime wrapper calls (functools.wraps keeps it)
        result = entry.serialize()  # the cache entry the graph was read from: what its compile found
        meta = result.runtime_metadata
        plain = all(isinstance(m, (int, PlainTensorMeta))  # a size, or a tensor that is no subclass
                    for m in (*meta.subclass_inp_meta, *(meta.subclass_fw_graph_out_meta or ())))
        if (type(graph) is not CompiledFxGraph or wrapper.__code__.co_name != "runtime_wrapper"  # nothing between
                or result.compiled_bw is not None or not plain or not passes_through(meta)):
            return False
        dynamic = [(i, o.dynamic_dims) for i, o in enumerate(meta.output_info) if o.dynamic_dims is not None]
    except (AttributeError, ImportError, KeyError, TypeError):  # a torch whose wrappers are laid out otherwise
        return False

    def kernel(*args: Any) -> Any:
        outs = graph.current_callable(list(args))  # looked up each call, as the graph's own __call__ does
        for i, dims in dynamic:  # the marks the wrapper leaves for a later trace of these outputs
            mark_dynamo_propagated_dynamic_indices(outs[i], dims)
        return outs

    kernel.__wrapped__ = scope[backend_id]  # torch's call, for whoever must compare (tests, benchmarks/kernel_call.py)
    scope[backend_id] = kernel
    return True


def passes_through(meta: Any) -> bool:
    """Whether AOTAutograd's runtime wrapper, for a graph of this ``ViewAndMutationMeta``, hands inductor's outputs
    back as they come: no input it must write back, no output it must rebuild as an alias, no randomness or effect
    tokens to thread through, no grad mode to restore."""
    return (meta.num_mutated_inp_runtime_indices == 0 and meta.num_outputs_aliased == 0
            and meta.num_intermediate_bases == 0 and meta.grad_enabled_mutation is None
            and not meta.is_rng_op_functionalized and not meta.tokens and meta.num_unsafe_view_outputs == 0
            and not meta.traced_tangents)
