// A host tier of raw span rows that outlives the memories reading it (sekv_native.h: sekv_host_rows_*).
#include "sekv_internal.h"

#include <cstring>

static ggml_backend_buffer_type_t host_buffer_type(const sekv_model * model) {
    ggml_backend_buffer_type_t buft = model->gpu_dev ? ggml_backend_dev_host_buffer_type(model->gpu_dev) : nullptr;
    return buft != nullptr ? buft : ggml_backend_get_default_buffer_type(model->cpu);
}

static void release(sekv_host_rows * rows) {
    if (rows->buf) ggml_backend_buffer_free(rows->buf);
    if (rows->ctx) ggml_free(rows->ctx);
    rows->buf = nullptr;
    rows->ctx = nullptr;
}

// New tables with room for `capacity` spans (+ the zero slot), the held spans copied over.
static bool grow(sekv_host_rows * rows, int32_t capacity) {
    const sekv_model_info & info = rows->model->info;
    const int64_t L = info.n_layer, KV = info.n_head_kv, D = info.head_dim, l = rows->span_rows;
    ggml_init_params ip = {ggml_tensor_overhead() * (size_t) (2 * L + 2), nullptr, true};
    ggml_context * ctx = ggml_init(ip);
    const ggml_type type = sekv_host_type(rows->host_quant);
    std::vector<ggml_tensor *> rk(L, nullptr), rvt(L, nullptr);
    for (int64_t il = 0; il < L; ++il) {
        if (rows->model->local[il]) continue;
        rk[il] = ggml_new_tensor_3d(ctx, type, D * l, capacity + 1, KV);
        rvt[il] = ggml_new_tensor_3d(ctx, type, l * D, capacity + 1, KV);
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, host_buffer_type(rows->model));
    if (buf == nullptr) {
        ggml_free(ctx);
        sekv_set_error("could not allocate the host rows' buffer (" + std::to_string(capacity) + " spans)");
        return false;
    }
    // the zero slots, and a step's reads of this buffer stay on the CPU (only gathered rows cross to a GPU)
    ggml_backend_buffer_clear(buf, 0);
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    const bool host = rows->buf == nullptr || (ggml_backend_buffer_is_host(rows->buf) && ggml_backend_buffer_is_host(buf));
    std::vector<uint8_t> staging;
    for (int64_t il = 0; il < L && rows->buf != nullptr; ++il) {
        if (rk[il] == nullptr) continue;
        for (auto [from, to] : {std::pair{rows->rk[il], rk[il]}, std::pair{rows->rvt[il], rvt[il]}}) {
            const size_t bytes = (size_t) rows->count[il] * from->nb[1];  // the same row size in both
            for (int64_t h = 0; h < KV && bytes > 0; ++h) {
                if (host) {
                    std::memcpy((char *) to->data + h * to->nb[2], (const char *) from->data + h * from->nb[2], bytes);
                } else {
                    staging.resize(bytes);
                    ggml_backend_tensor_get(from, staging.data(), (size_t) (h * from->nb[2]), bytes);
                    ggml_backend_tensor_set(to, staging.data(), (size_t) (h * to->nb[2]), bytes);
                }
            }
        }
    }
    release(rows);
    rows->ctx = ctx;
    rows->buf = buf;
    rows->rk = rk;
    rows->rvt = rvt;
    rows->capacity = capacity;
    rows->generation += 1;
    return true;
}

sekv_host_rows * sekv_host_rows_create(sekv_model * model, int32_t span_rows, int32_t host_quant) {
    const sekv_model_info & info = model->info;
    if (span_rows < 1) {
        sekv_set_error("sekv_host_rows_create: span_rows must be >= 1");
        return nullptr;
    }
    if (host_quant < 0 || host_quant > 2) {
        sekv_set_error("sekv_host_rows_create: host_quant must be 0 (f16), 1 (q8_0) or 2 (q4_0)");
        return nullptr;
    }
    if (host_quant != 0 && (int64_t) span_rows * info.head_dim % 32 != 0) {
        sekv_set_error("sekv_host_rows_create: a block-quantized tier needs span_rows * head_dim to be a multiple of 32");
        return nullptr;
    }
    auto * rows = new sekv_host_rows();
    rows->model = model;
    rows->span_rows = span_rows;
    rows->host_quant = host_quant;
    rows->count.assign((size_t) info.n_layer, 0);
    if (!grow(rows, 0)) {
        delete rows;
        return nullptr;
    }
    return rows;
}

void sekv_host_rows_free(sekv_host_rows * rows) {
    if (rows == nullptr) return;
    release(rows);
    delete rows;
}

int sekv_host_rows_reserve(sekv_host_rows * rows, int32_t n_spans) {
    if (n_spans <= rows->capacity) return 0;
    return grow(rows, n_spans) ? 0 : -1;
}

int sekv_host_rows_set(sekv_host_rows * rows, int32_t layer, int32_t first, int32_t n, const uint16_t * k,
                       const uint16_t * v) {
    const sekv_model_info & info = rows->model->info;
    if (layer < 0 || layer >= info.n_layer || rows->model->local[layer]) {
        sekv_set_error("sekv_host_rows_set: layer " + std::to_string(layer) + " is not a global layer");
        return -1;
    }
    const int32_t held = rows->count[(size_t) layer];
    if (first < 0 || first > held || n < 0) {
        sekv_set_error("sekv_host_rows_set: spans [" + std::to_string(first) + ", +" + std::to_string(n) +
                       ") do not follow the " + std::to_string(held) + " the layer holds");
        return -1;
    }
    if (first + n > rows->capacity) {
        // an eighth more than asked: a document read chunk by chunk moves its tables a few dozen times, not per chunk
        const int64_t want = (int64_t) first + n, room = want + want / 8 + 64;
        if (!grow(rows, (int32_t) std::min<int64_t>(room, INT32_MAX - 1))) return -1;
    }
    if (first < held) {
        rows->generation += 1;  // spans a memory may read are replaced
    }
    const int64_t KV = info.n_head_kv, D = info.head_dim, l = rows->span_rows;
    sekv_set_span_major(rows->rk[(size_t) layer], k, first, n, KV, l * D);
    sekv_set_span_major(rows->rvt[(size_t) layer], v, first, n, KV, l * D);
    rows->count[(size_t) layer] = first + n;
    return 0;
}

int32_t sekv_host_rows_held(const sekv_host_rows * rows) {
    int32_t held = INT32_MAX;
    for (size_t il = 0; il < rows->count.size(); ++il) {
        if (!rows->model->local[il]) held = std::min(held, rows->count[il]);
    }
    return held == INT32_MAX ? 0 : held;
}

int32_t sekv_host_rows_count(const sekv_host_rows * rows) { return sekv_host_rows_held(rows); }

uint64_t sekv_host_rows_bytes(const sekv_host_rows * rows) {
    return rows->buf != nullptr ? ggml_backend_buffer_get_size(rows->buf) : 0;
}
