// The SeKV memory: device-tier and host-tier tensors, and importing a memory the torch engine built.
#include "sekv_internal.h"

#include <algorithm>
#include <cmath>
#include <cstring>

static bool check_params(const sekv_memory_params & p, const sekv_model & model) {
    const sekv_model_info & info = model.info;
    if (p.exact_capacity < 1 || p.n_spans < 0 || p.span_rows < 1 || p.rank < 1 || p.zoom_k < 0 ||
        p.n_spans < 0) {
        sekv_set_error("sekv_memory_params: need exact_capacity >= 1, span_rows >= 1, rank >= 1, zoom_k >= 0, n_spans >= 0");
        return false;
    }
    for (int32_t i = 0; p.n_pinned != nullptr && i < info.n_layer; ++i) {
        if (p.n_pinned[i] < 0) {
            sekv_set_error("sekv_memory_params: n_pinned must be >= 0");
            return false;
        }
    }
    for (int32_t i = 0; i < 2 * info.n_layer; ++i) {
        if (p.n_factored == nullptr || p.n_raw == nullptr || p.n_factored[i] < 0 || p.n_raw[i] < 0) {
            sekv_set_error("sekv_memory_params: n_factored and n_raw are needed, >= 0");
            return false;
        }
        if (model.local[i / 2]) {
            if (p.n_factored[i] + p.n_raw[i] != 0 || (p.n_pinned != nullptr && p.n_pinned[i / 2] != 0)) {
                sekv_set_error("sekv_memory_params: layer " + std::to_string(i / 2) + " is a sliding-window layer: "
                               "it stores no spans and no pins");
                return false;
            }
        } else if (p.n_factored[i] + p.n_raw[i] != p.n_spans) {
            sekv_set_error("sekv_memory_params: every layer's keys and values store each span once "
                           "(n_factored + n_raw == n_spans)");
            return false;
        }
    }
    if (p.rank > p.span_rows && p.rank > info.head_dim) {
        sekv_set_error("sekv_memory_params: rank larger than both span_rows and head_dim");
        return false;
    }
    if (p.host_quant < 0 || p.host_quant > 2) {
        sekv_set_error("sekv_memory_params: host_quant must be 0 (f16), 1 (q8_0) or 2 (q4_0)");
        return false;
    }
    if (p.host_quant != 0 && ((int64_t) p.rank * p.span_rows % 32 != 0 || info.head_dim % 32 != 0)) {
        sekv_set_error("sekv_memory_params: a block-quantized host tier needs rank * span_rows and head_dim to be "
                       "multiples of 32");
        return false;
    }
    if (!(p.summary_bias >= 0.0f)) {
        sekv_set_error("sekv_memory_params: summary_bias must be >= 0");
        return false;
    }
    if (p.host_rows != nullptr) {
        const sekv_host_rows & rows = *p.host_rows;
        if (rows.model != &model || rows.span_rows != p.span_rows || rows.host_quant != p.host_quant) {
            sekv_set_error("sekv_memory_params: host_rows of another model, span_rows or host_quant");
            return false;
        }
        if (sekv_host_rows_held(&rows) < p.n_spans) {
            sekv_set_error("sekv_memory_params: host_rows hold " + std::to_string(sekv_host_rows_held(&rows)) +
                           " spans, the memory has " + std::to_string(p.n_spans));
            return false;
        }
        for (int32_t i = 0; i < 2 * info.n_layer; ++i) {
            if (!model.local[i / 2] && p.n_factored[i] != 0) {
                sekv_set_error("sekv_memory_params: a memory on host_rows stores every span raw (n_factored == 0)");
                return false;
            }
        }
    }
    return true;
}

sekv_memory * sekv_memory_create(sekv_model * model, const sekv_memory_params * params) {
    const sekv_model_info & info = model->info;
    if (!check_params(*params, *model)) {
        return nullptr;
    }
    if (params->router < 0 || params->router > 2) {
        sekv_set_error("sekv_memory_params: router must be 0 (training-free), 1 (learned) or 2 (union of both)");
        return nullptr;
    }
    if (params->router && model->router_dim == 0) {
        sekv_set_error("sekv_memory_params: router = 1 but the model has no learned router "
                       "(none in its GGUF; set one with sekv_model_set_router)");
        return nullptr;
    }
    auto * mem = new sekv_memory();
    mem->model = model;
    mem->params = *params;
    const sekv_host_rows * shared = params->host_rows;
    mem->host_generation = shared != nullptr ? shared->generation : 0;
    // the caller's arrays: copied per layer below
    mem->params.n_factored = mem->params.n_raw = mem->params.n_pinned = nullptr;
    const int64_t L = info.n_layer, KV = info.n_head_kv, D = info.head_dim;
    const int64_t cap = params->exact_capacity, S = std::max<int64_t>(params->n_spans, 1);
    const int64_t l = params->span_rows, R = params->rank, k = std::max<int32_t>(params->zoom_k, 1);

    ggml_init_params ip = {ggml_tensor_overhead() * (size_t) (L * 12 + 16), nullptr, true};
    mem->device_ctx = ggml_init(ip);
    mem->host_ctx = ggml_init(ip);
    mem->layers.resize(L);
    mem->ring = info.sliding_window > 0 ? sekv_ring_rows(info.sliding_window) : 0;
    mem->ring_pos.assign((size_t) mem->ring, -1);
    const ggml_type host = sekv_host_type(params->host_quant);
    for (int64_t il = 0; il < L; ++il) {
        auto & t = mem->layers[il];
        if (model->local[il]) {  // its window exactly, nothing else
            t.local = true;
            t.ring_k = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F16, D, mem->ring, KV);
            t.ring_v = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F16, D, mem->ring, KV);
            continue;
        }
        for (int kv = 0; kv < 2; ++kv) {
            t.n_factored[kv] = params->n_factored[2 * il + kv];
            t.n_raw[kv] = params->n_raw[2 * il + kv];
        }
        // + 1: the zero slot
        const int64_t Fk = t.n_factored[0] + 1, Fv = t.n_factored[1] + 1, Wk = t.n_raw[0] + 1, Wv = t.n_raw[1] + 1;
        t.ek = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F16, D, cap, KV);
        t.evt = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F16, cap, D, KV);
        t.sk = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F16, D, S, KV);
        t.svt = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F16, S, D, KV);
        if (shared != nullptr) {  // every span raw, span s in row s of the shared tables
            t.rk = shared->rk[(size_t) il];
            t.rvt = shared->rvt[(size_t) il];
        } else {
            t.uk = ggml_new_tensor_3d(mem->host_ctx, host, R * l, Fk, KV);
            t.wk = ggml_new_tensor_3d(mem->host_ctx, host, R * D, Fk, KV);
            t.uv = ggml_new_tensor_3d(mem->host_ctx, host, R * l, Fv, KV);
            t.wv = ggml_new_tensor_3d(mem->host_ctx, host, R * D, Fv, KV);
            t.rk = ggml_new_tensor_3d(mem->host_ctx, host, D * l, Wk, KV);
            t.rvt = ggml_new_tensor_3d(mem->host_ctx, host, l * D, Wv, KV);
        }
        t.k_fslot = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_I32, 1, S, KV);
        t.k_rslot = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_I32, 1, S, KV);
        t.v_fslot = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_I32, 1, S, KV);
        t.v_rslot = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_I32, 1, S, KV);
        if (params->router) {
            t.route_k = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F16, model->router_dim, S, KV);
        }
        t.pin_capacity = params->n_pinned != nullptr ? params->n_pinned[il] : 0;
        if (t.pin_capacity > 0) {
            t.pk = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F16, D, t.pin_capacity, KV);
            t.pvt = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F16, t.pin_capacity, D, KV);
            t.pin_bias = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F32, S, 1, 1);
        }
    }
    mem->router_dim = params->router ? model->router_dim : 0;
    mem->route_bias = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F32, S, 1, 1);
    mem->coarse_bias = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F32, 1, S, 1);
    mem->row_pos = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_I32, l, S, KV);
    mem->row_mask = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F32, l, S, KV);
    mem->neg_inf = ggml_new_tensor_3d(mem->device_ctx, GGML_TYPE_F32, 1, k, KV);

    ggml_backend_t main = model->gpu != nullptr ? model->gpu : model->cpu;
    ggml_backend_buffer_type_t host_buft = model->gpu_dev ? ggml_backend_dev_host_buffer_type(model->gpu_dev) : nullptr;
    if (host_buft == nullptr) {
        host_buft = ggml_backend_get_default_buffer_type(model->cpu);
    }
    mem->device_buf = ggml_backend_alloc_ctx_tensors_from_buft(mem->device_ctx, ggml_backend_get_default_buffer_type(main));
    if (shared == nullptr) {
        mem->host_buf = ggml_backend_alloc_ctx_tensors_from_buft(mem->host_ctx, host_buft);
    }
    if (mem->device_buf == nullptr || (shared == nullptr && mem->host_buf == nullptr)) {
        sekv_set_error("could not allocate the SeKV memory buffers");
        sekv_memory_free(mem);
        return nullptr;
    }
    ggml_backend_buffer_clear(mem->device_buf, 0);
    if (mem->host_buf != nullptr) {
        // the scheduler runs an op where its "weights" live: ops reading the host tier stay on the CPU, so only
        // the rows they gather cross to the GPU
        ggml_backend_buffer_set_usage(mem->host_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_buffer_clear(mem->host_buf, 0);
    }
    std::vector<float> ninf((size_t) (k * KV), -INFINITY);
    ggml_backend_tensor_set(mem->neg_inf, ninf.data(), 0, ggml_nbytes(mem->neg_inf));
    mem->layer_exact.assign(L, 0);
    mem->layer_spans_set.assign(L, params->n_spans == 0);
    mem->layer_routing_set.assign(L, params->n_spans == 0 || !params->router);
    for (int64_t il = 0; il < L; ++il) {
        if (model->local[il]) mem->layer_spans_set[il] = mem->layer_routing_set[il] = true;
    }
    mem->last_zoom.assign(L, {});
    mem->last_zoom_k.assign(L, 0);
    if (model->gpu != nullptr || params->scheduler) {
        ggml_backend_t backends[2];
        int n = 0;
        if (model->gpu != nullptr) backends[n++] = model->gpu;
        backends[n++] = model->cpu;  // the scheduler wants the CPU last
        mem->sched = ggml_backend_sched_new(backends, nullptr, n, SEKV_SCHED_GRAPH_SIZE, false, false);
    } else {
        mem->allocr = ggml_gallocr_new(ggml_backend_get_default_buffer_type(model->cpu));
    }
    mem->spans_set = params->n_spans == 0;
    return mem;
}

void sekv_memory_free(sekv_memory * mem) {
    if (mem == nullptr) {
        return;
    }
    if (mem->allocr) ggml_gallocr_free(mem->allocr);
    if (mem->sched) ggml_backend_sched_free(mem->sched);
    if (mem->device_buf) ggml_backend_buffer_free(mem->device_buf);
    if (mem->host_buf) ggml_backend_buffer_free(mem->host_buf);
    if (mem->device_ctx) ggml_free(mem->device_ctx);
    if (mem->host_ctx) ggml_free(mem->host_ctx);
    delete mem;
}

// a layer index in range, of the kind the call needs (a global layer's spans and exact rows, a local layer's window)
static bool check_layer(const sekv_memory * mem, int32_t layer, bool local = false) {
    if (layer < 0 || layer >= mem->model->info.n_layer) {
        sekv_set_error("layer index out of range");
        return false;
    }
    if (mem->layers[layer].local != local) {
        sekv_set_error("layer " + std::to_string(layer) + (local ? " is not a sliding-window layer"
                                                                 : " is a sliding-window layer (it holds a window)"));
        return false;
    }
    return true;
}

// [KV][n][D] half rows -> a [D, cap, KV] tensor (keys) or its transpose [cap, D, KV] (values).
static void set_rows_by_head(ggml_tensor * dst, const uint16_t * src, int64_t n, int64_t D, int64_t KV, bool transposed) {
    const int64_t cap = transposed ? dst->ne[0] : dst->ne[1];
    std::vector<uint16_t> buf;
    if (!transposed) {
        for (int64_t h = 0; h < KV; ++h) {
            ggml_backend_tensor_set(dst, src + h * n * D, h * dst->nb[2], (size_t) (n * D) * 2);
        }
        return;
    }
    buf.assign((size_t) (cap * D * KV), 0);
    for (int64_t h = 0; h < KV; ++h) {
        for (int64_t i = 0; i < n; ++i) {
            for (int64_t d = 0; d < D; ++d) {
                buf[(h * D + d) * cap + i] = src[(h * n + i) * D + d];
            }
        }
    }
    ggml_backend_tensor_set(dst, buf.data(), 0, buf.size() * 2);
}

int sekv_memory_set_exact(sekv_memory * mem, int32_t layer, int32_t n_rows, const uint16_t * k, const uint16_t * v) {
    if (!check_layer(mem, layer)) return -1;
    if (n_rows < 0 || n_rows >= mem->params.exact_capacity) {
        sekv_set_error("exact rows must leave room below exact_capacity for the tokens to decode");
        return -1;
    }
    const int64_t KV = mem->model->info.n_head_kv, D = mem->model->info.head_dim;
    auto & t = mem->layers[layer];
    set_rows_by_head(t.ek, k, n_rows, D, KV, false);
    set_rows_by_head(t.evt, v, n_rows, D, KV, true);
    mem->layer_exact[layer] = n_rows;
    mem->n_exact = n_rows;
    return 0;
}

int sekv_memory_set_spans(sekv_memory * mem, const int32_t * start, const int32_t * length) {
    const int64_t S = mem->params.n_spans, l = mem->params.span_rows, KV = mem->model->info.n_head_kv;
    if (S == 0) return 0;
    std::vector<float> route((size_t) S), coarse((size_t) S);
    std::vector<int32_t> pos((size_t) (l * S * KV));
    std::vector<float> mask((size_t) (l * S * KV));
    for (int64_t s = 0; s < S; ++s) {
        if (length[s] < 1 || length[s] > l || start[s] < 0) {
            sekv_set_error("span " + std::to_string(s) + ": length outside [1, span_rows] or negative start");
            return -1;
        }
        const float log_len = std::log((float) length[s]);
        route[s] = log_len;
        coarse[s] = mem->params.summary_bias > 0.0f ? mem->params.summary_bias * log_len : -INFINITY;
        for (int64_t h = 0; h < KV; ++h) {
            for (int64_t t = 0; t < l; ++t) {
                const size_t i = (size_t) ((h * S + s) * l + t);
                pos[i] = start[s] + (int32_t) t;
                mask[i] = t < length[s] ? 0.0f : -INFINITY;
            }
        }
    }
    ggml_backend_tensor_set(mem->route_bias, route.data(), 0, route.size() * 4);
    ggml_backend_tensor_set(mem->coarse_bias, coarse.data(), 0, coarse.size() * 4);
    ggml_backend_tensor_set(mem->row_pos, pos.data(), 0, pos.size() * 4);
    ggml_backend_tensor_set(mem->row_mask, mask.data(), 0, mask.size() * 4);
    mem->spans_set = true;
    return 0;
}

void sekv_set_span_major(ggml_tensor * dst, const uint16_t * src, int64_t first, int64_t S, int64_t KV, int64_t width) {
    const bool f16 = dst->type == GGML_TYPE_F16;
    std::vector<float> row(f16 ? 0 : (size_t) width);
    std::vector<uint8_t> packed(f16 ? 0 : ggml_row_size(dst->type, width));
    for (int64_t h = 0; h < KV; ++h) {
        for (int64_t s = 0; s < S; ++s) {
            const uint16_t * from = src + (s * KV + h) * width;
            const size_t at = (size_t) (h * dst->nb[2] + (first + s) * dst->nb[1]);
            if (f16) {
                ggml_backend_tensor_set(dst, from, at, (size_t) width * 2);
                continue;
            }
            ggml_fp16_to_fp32_row(reinterpret_cast<const ggml_fp16_t *>(from), row.data(), width);
            ggml_quantize_chunk(dst->type, row.data(), packed.data(), 0, 1, width, nullptr);
            ggml_backend_tensor_set(dst, packed.data(), at, packed.size());
        }
    }
}

// One store (keys or values) of a layer: slot tables from is_raw, then the factored and raw rows.
static bool set_store(sekv_memory * mem, const sekv_span_rows & rows, ggml_tensor * u, ggml_tensor * w,
                      ggml_tensor * raw, ggml_tensor * fslot, ggml_tensor * rslot, int32_t F, int32_t W) {
    const int64_t S = mem->params.n_spans, KV = mem->model->info.n_head_kv, D = mem->model->info.head_dim;
    const int64_t l = mem->params.span_rows, R = mem->params.rank;
    std::vector<int32_t> f((size_t) (S * KV)), r((size_t) (S * KV));
    int32_t nf = 0, nr = 0;
    for (int64_t s = 0; s < S; ++s) {
        const bool is_raw = rows.is_raw[s] != 0;
        if ((is_raw && nr >= W) || (!is_raw && nf >= F)) {
            sekv_set_error("a layer stores more factored or raw spans than sekv_memory_params said (n_factored / n_raw)");
            return false;
        }
        for (int64_t h = 0; h < KV; ++h) {
            f[(size_t) (h * S + s)] = is_raw ? F : nf;  // F, W: the zero slots
            r[(size_t) (h * S + s)] = is_raw ? nr : W;
        }
        (is_raw ? nr : nf) += 1;
    }
    ggml_backend_tensor_set(fslot, f.data(), 0, f.size() * 4);
    ggml_backend_tensor_set(rslot, r.data(), 0, r.size() * 4);
    sekv_set_span_major(u, rows.u, 0, nf, KV, l * R);
    sekv_set_span_major(w, rows.w, 0, nf, KV, D * R);
    sekv_set_span_major(raw, rows.raw, 0, nr, KV, l * D);
    return true;
}

int sekv_memory_set_layer_spans(sekv_memory * mem, int32_t layer, const uint16_t * sum_k, const uint16_t * sum_v,
                                const sekv_span_rows * keys, const sekv_span_rows * values) {
    if (!check_layer(mem, layer)) return -1;
    const int64_t S = mem->params.n_spans, KV = mem->model->info.n_head_kv, D = mem->model->info.head_dim;
    if (S == 0) return 0;
    auto & t = mem->layers[layer];
    set_rows_by_head(t.sk, sum_k, S, D, KV, false);
    set_rows_by_head(t.svt, sum_v, S, D, KV, true);
    if (mem->params.host_rows != nullptr) {
        if (keys != nullptr || values != nullptr) {
            sekv_set_error("this memory reads its spans from host_rows: set_layer_spans takes summaries only");
            return -1;
        }
        std::vector<int32_t> slot((size_t) (S * KV));
        for (int64_t h = 0; h < KV; ++h) {
            for (int64_t s = 0; s < S; ++s) slot[(size_t) (h * S + s)] = (int32_t) s;
        }
        for (ggml_tensor * table : {t.k_rslot, t.v_rslot}) ggml_backend_tensor_set(table, slot.data(), 0, slot.size() * 4);
        mem->layer_spans_set[layer] = true;
        return 0;
    }
    if (keys == nullptr || values == nullptr) {
        sekv_set_error("set_layer_spans: keys and values rows are needed (the memory has its own host tier)");
        return -1;
    }
    if (!set_store(mem, *keys, t.uk, t.wk, t.rk, t.k_fslot, t.k_rslot, t.n_factored[0], t.n_raw[0]) ||
        !set_store(mem, *values, t.uv, t.wv, t.rvt, t.v_fslot, t.v_rslot, t.n_factored[1], t.n_raw[1])) {
        return -1;
    }
    mem->layer_spans_set[layer] = true;
    return 0;
}

int sekv_memory_set_layer_routing(sekv_memory * mem, int32_t layer, const uint16_t * route_k) {
    if (!check_layer(mem, layer)) return -1;
    if (!mem->params.router) {
        sekv_set_error("this memory routes without learned routing keys (sekv_memory_params.router = 0)");
        return -1;
    }
    const int64_t S = mem->params.n_spans, KV = mem->model->info.n_head_kv;
    if (S == 0) return 0;
    set_rows_by_head(mem->layers[layer].route_k, route_k, S, mem->router_dim, KV, false);
    mem->layer_routing_set[layer] = true;
    return 0;
}

int sekv_memory_set_layer_pins(sekv_memory * mem, int32_t layer, int32_t n_rows, const uint16_t * k,
                               const uint16_t * v, const int32_t * pinned) {
    if (!check_layer(mem, layer)) return -1;
    auto & t = mem->layers[layer];
    if (n_rows < 0 || n_rows > t.pin_capacity) {
        sekv_set_error("layer " + std::to_string(layer) + ": " + std::to_string(n_rows) +
                       " pinned rows, room for " + std::to_string(t.pin_capacity) + " (sekv_memory_params.n_pinned)");
        return -1;
    }
    const int64_t S = mem->params.n_spans, KV = mem->model->info.n_head_kv, D = mem->model->info.head_dim;
    if (t.pin_capacity == 0 || S == 0) return 0;
    std::vector<float> bias((size_t) S);
    int32_t n_spans = 0;
    for (int64_t s = 0; s < S; ++s) {
        bias[s] = pinned[s] != 0 ? -INFINITY : 0.0f;
        n_spans += pinned[s] != 0;
    }
    set_rows_by_head(t.pk, k, n_rows, D, KV, false);
    set_rows_by_head(t.pvt, v, n_rows, D, KV, true);
    ggml_backend_tensor_set(t.pin_bias, bias.data(), 0, bias.size() * sizeof(float));
    t.n_pin_rows = n_rows;
    t.n_pinned_spans = n_spans;
    return 0;
}

int sekv_memory_get_exact(const sekv_memory * mem, int32_t layer, int32_t first, int32_t n, uint16_t * k, uint16_t * v) {
    if (!check_layer(mem, layer)) return -1;
    if (first < 0 || n < 0 || first + n > mem->n_exact) {
        sekv_set_error("exact rows out of range");
        return -1;
    }
    const int64_t KV = mem->model->info.n_head_kv, D = mem->model->info.head_dim;
    const auto & t = mem->layers[layer];
    std::vector<uint16_t> col((size_t) n);
    for (int64_t h = 0; h < KV; ++h) {
        ggml_backend_tensor_get(t.ek, k + h * n * D, (size_t) (h * t.ek->nb[2] + first * t.ek->nb[1]), (size_t) (n * D) * 2);
        for (int64_t d = 0; d < D; ++d) {  // values are stored transposed: one strip per (head, dim)
            ggml_backend_tensor_get(t.evt, col.data(), (size_t) (h * t.evt->nb[2] + d * t.evt->nb[1] + first * 2),
                                    (size_t) n * 2);
            for (int32_t i = 0; i < n; ++i) v[(h * n + i) * D + d] = col[i];
        }
    }
    return 0;
}

int sekv_memory_set_window(sekv_memory * mem, int32_t layer, int32_t position, int32_t n_rows, const uint16_t * k,
                           const uint16_t * v) {
    if (!check_layer(mem, layer, true)) return -1;
    const int32_t window = mem->model->info.sliding_window;
    if (position < 0 || n_rows < 0 || n_rows > window) {
        sekv_set_error("window rows: need position >= 0 and 0 <= n_rows <= sliding_window");
        return -1;
    }
    const int64_t KV = mem->model->info.n_head_kv, D = mem->model->info.head_dim, C = mem->ring;
    auto & t = mem->layers[layer];
    for (int32_t i = 0; i < n_rows; ++i) {
        const int64_t row = (position + i) % C;
        for (int64_t h = 0; h < KV; ++h) {
            const size_t at = (size_t) (h * t.ring_k->nb[2] + row * t.ring_k->nb[1]), bytes = (size_t) D * 2;
            ggml_backend_tensor_set(t.ring_k, k + (h * n_rows + i) * D, at, bytes);
            ggml_backend_tensor_set(t.ring_v, v + (h * n_rows + i) * D, at, bytes);
        }
    }
    std::fill(mem->ring_pos.begin(), mem->ring_pos.end(), -1);
    for (int32_t i = 0; i < n_rows; ++i) mem->ring_pos[(size_t) ((position + i) % C)] = position + i;
    t.window_end = position + n_rows;
    return 0;
}

int sekv_memory_get_window(const sekv_memory * mem, int32_t layer, int32_t position, int32_t n, uint16_t * k,
                           uint16_t * v) {
    if (!check_layer(mem, layer, true)) return -1;
    const int64_t KV = mem->model->info.n_head_kv, D = mem->model->info.head_dim, C = mem->ring;
    const auto & t = mem->layers[layer];
    for (int32_t i = 0; i < n; ++i) {
        const int64_t row = (position + i) % C;
        if (position < 0 || mem->ring_pos[(size_t) row] != position + i) {
            sekv_set_error("window rows out of range: the ring no longer (or never) held them");
            return -1;
        }
        for (int64_t h = 0; h < KV; ++h) {
            const size_t at = (size_t) (h * t.ring_k->nb[2] + row * t.ring_k->nb[1]), bytes = (size_t) D * 2;
            ggml_backend_tensor_get(t.ring_k, k + (h * n + i) * D, at, bytes);
            ggml_backend_tensor_get(t.ring_v, v + (h * n + i) * D, at, bytes);
        }
    }
    return 0;
}

int32_t sekv_memory_n_exact(const sekv_memory * mem) { return mem->n_exact; }

int sekv_memory_bytes(const sekv_memory * mem, uint64_t * device, uint64_t * host, uint64_t * compute) {
    *device = ggml_backend_buffer_get_size(mem->device_buf);
    // the learned router's parameters sit beside the weights only for the memories that route with them
    if (mem->params.router && mem->model->router_buf != nullptr) {
        *device += ggml_backend_buffer_get_size(mem->model->router_buf);
    }
    *host = mem->host_buf != nullptr ? ggml_backend_buffer_get_size(mem->host_buf) : 0;  // borrowed rows: their own
    *compute = 0;
    if (mem->allocr) {
        *compute = ggml_gallocr_get_buffer_size(mem->allocr, 0);
    } else {
        for (ggml_backend_t b : {mem->model->gpu, mem->model->cpu}) {
            if (b != nullptr) *compute += ggml_backend_sched_get_buffer_size(mem->sched, b);
        }
    }
    return 0;
}

int32_t sekv_memory_last_zoom(const sekv_memory * mem, int32_t layer, int32_t * spans) {
    if (layer < 0 || layer >= mem->model->info.n_layer) {
        sekv_set_error("layer index out of range");
        return -1;
    }
    const auto & z = mem->last_zoom[layer];
    std::copy(z.begin(), z.end(), spans);
    return z.empty() ? 0 : mem->last_zoom_k[layer];
}
