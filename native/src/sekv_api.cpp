// One decode step: build the graph, allocate its compute buffer, run it, read logits and zoom choices.
#include "sekv_internal.h"

int sekv_decode(sekv_memory * mem, int32_t token, int32_t position, float * logits) {
    const sekv_model_info & info = mem->model->info;
    if (!mem->spans_set) {
        sekv_set_error("the span table was never set (sekv_memory_set_spans)");
        return -1;
    }
    for (bool done : mem->layer_spans_set) {
        if (!done) {
            sekv_set_error("a layer's spans were never set (sekv_memory_set_layer_spans)");
            return -1;
        }
    }
    for (bool done : mem->layer_routing_set) {
        if (!done) {
            sekv_set_error("a layer's routing keys were never set (sekv_memory_set_layer_routing)");
            return -1;
        }
    }
    if (mem->params.router && mem->router_dim != mem->model->router_dim) {
        sekv_set_error("the model's router was replaced by one of another routing_dim since this memory was made");
        return -1;
    }
    for (int32_t rows : mem->layer_exact) {
        if (rows != mem->n_exact) {
            sekv_set_error("layers hold different numbers of exact rows: import every layer before decoding");
            return -1;
        }
    }
    if (mem->n_exact + 1 >= mem->params.exact_capacity) {
        sekv_set_error("the memory is full: exact_capacity reached");
        return -1;
    }
    if (token < 0 || token >= info.n_vocab || position < 0) {
        sekv_set_error("token id out of range or negative position");
        return -1;
    }
    const size_t meta = ggml_tensor_overhead() * SEKV_GRAPH_SIZE + ggml_graph_overhead_custom(SEKV_GRAPH_SIZE, false);
    mem->graph_meta.resize(meta);
    ggml_init_params ip = {meta, mem->graph_meta.data(), true};
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * inp_token = nullptr, * inp_pos = nullptr;
    sekv_zoom_outputs zoom;
    ggml_cgraph * gf = sekv_build_decode_graph(mem, ctx, &inp_token, &inp_pos, zoom);
    if (mem->sched != nullptr) {
        ggml_backend_sched_reset(mem->sched);
    }
    if (!(mem->sched != nullptr ? ggml_backend_sched_alloc_graph(mem->sched, gf) : ggml_gallocr_alloc_graph(mem->allocr, gf))) {
        ggml_free(ctx);
        sekv_set_error("could not allocate the decode graph's compute buffer");
        return -1;
    }
    ggml_backend_tensor_set(inp_token, &token, 0, sizeof(token));
    ggml_backend_tensor_set(inp_pos, &position, 0, sizeof(position));
    const ggml_status status = mem->sched != nullptr ? ggml_backend_sched_graph_compute(mem->sched, gf)
                                                     : ggml_backend_graph_compute(mem->model->cpu, gf);
    if (status != GGML_STATUS_SUCCESS) {
        ggml_free(ctx);
        sekv_set_error("the decode graph failed to compute");
        return -1;
    }
    ggml_tensor * out = ggml_graph_get_tensor(gf, "logits");
    ggml_backend_tensor_get(out, logits, 0, (size_t) info.n_vocab * sizeof(float));
    std::vector<float> passed;
    for (size_t il = 0; il < zoom.chosen.size(); ++il) {
        auto & dst = mem->last_zoom[il];
        ggml_tensor * chosen = zoom.chosen[il];
        if (chosen == nullptr) {
            dst.clear();
            mem->last_zoom_k[il] = 0;
            continue;
        }
        dst.resize((size_t) ggml_nelements(chosen));
        ggml_backend_tensor_get(chosen, dst.data(), 0, dst.size() * sizeof(int32_t));
        if (zoom.passed[il] != nullptr) {  // same [k, KV] order as chosen
            passed.resize(dst.size());
            ggml_backend_tensor_get(zoom.passed[il], passed.data(), 0, passed.size() * sizeof(float));
            for (size_t i = 0; i < dst.size(); ++i) {
                if (passed[i] == 0.0f) dst[i] = -1;
            }
        }
        mem->last_zoom_k[il] = (int32_t) chosen->ne[0];
    }
    ggml_free(ctx);
    mem->n_exact += 1;
    for (int32_t & rows : mem->layer_exact) rows = mem->n_exact;
    return 0;
}
