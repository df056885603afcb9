// pie-ctx's decode step in C++: every layer of a small decode batch in one call, no Python
// between the operations (runtime/model/fused_step.py prepares it and decides when it runs).
//
// A layer is: RMSNorm, the fused q/k/v projection, LoRA deltas, RoPE, the K/V write into the
// paged pool, paged attention, o projection (+ deltas) and residual, RMSNorm, gate/up (+
// deltas), SiLU * up, down (+ deltas) and residual. The norms, RoPE, K/V write, attention and
// SiLU are cpu_ops.cpp's kernels called directly; each projection runs the kernel that
// kernel_choice.py's choose_kernels picked for its row bucket, as the same ATen op
// (at::linear, at::mm, mkldnn::_linear_pointwise, at::_int_mm, fbgemm's int8 linear,
// at::_weight_int4pack_mm_for_cpu, block_mm.cpp's block_mm and block_mm_q8, kquant_mm.cpp's
// kquant_mm_parts, strips_mm.cpp's f32_strips_mm and int8_strips_mm), so the step
// computes the eager forward's numbers.
//
// LoRA: one grouped kernel per projection for every adapter of the batch: the rows of one
// adapter read its (bf16) weights once, x @ A.T then (.) @ B.T per target block, fp32
// accumulation.
//
// Every stage opens a profiler range ("pie::...") so benchmarks/model.py can count and time
// what a step runs; outside a profiler a range costs one flag test.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <vector>

// cpu_ops.cpp's kernels (same extension module)
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor pool, int64_t layer,
                              torch::Tensor page_tables, torch::Tensor seq_start,
                              torch::Tensor num_cached, double scale);
void prefetch_paged_kv(torch::Tensor pool, int64_t layer, torch::Tensor page_tables,
                       torch::Tensor seq_start, torch::Tensor num_cached);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> quantize_rows(torch::Tensor x);
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
           int64_t head_dim);
void write_kv(torch::Tensor pool, int64_t layer, torch::Tensor kv, torch::Tensor pages,
              torch::Tensor slots);
torch::Tensor silu_mul(torch::Tensor gu);
torch::Tensor dequantize_int32(torch::Tensor acc, torch::Tensor xs, torch::Tensor ws,
                               torch::Tensor bias);
// strips_mm.cpp's
torch::Tensor int8_strips_mm(torch::Tensor xq, torch::Tensor packed, torch::Tensor sums,
                             int64_t N);
torch::Tensor f32_strips_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor bias,
                            int64_t N);

namespace {

namespace py = pybind11;

typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));

inline f16v loadf(const float* p) { f16v v; std::memcpy(&v, p, sizeof v); return v; }
inline f16v load_bf16(const uint16_t* p) {  // 16 bf16 -> 16 fp32 (exact)
  h16v h;
  std::memcpy(&h, p, sizeof h);
  return (f16v)(__builtin_convertvector(h, i16v) << 16);
}
inline float bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float hsum(f16v v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// dot of fp32 x[n] with bf16 w[n]
inline float dot_bf16(const float* x, const uint16_t* w, int64_t n) {
  f16v acc{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc += loadf(x + i) * load_bf16(w + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += x[i] * bf16(w[i]);
  return s;
}

// The projection kernels the step runs (Kernel::kind). STEP_KINDS (register_decode_step)
// names them as runtime/model/matmul.py does; Python reads the numbers from there
// (runtime/model/kernel_choice.py, step_kinds).
enum Kind : int64_t {
  MKL = 0, MM = 1, ONEDNN = 2, INT_MM = 3, FBGEMM = 4, INT4 = 5, BLOCKS = 6, BLOCKS_Q8 = 7,
  KQUANT = 8, INT8_STRIPS = 9, F32_STRIPS = 10
};

struct Kernel {
  int64_t kind = MKL;
  torch::Tensor w;      // the weight in the layout the kernel reads
  torch::Tensor scale;  // int8: per output row; int4: scales_and_zeros; blocks: d
  torch::Tensor bias;   // or undefined
  c10::IValue packed;   // fbgemm: its prepacked weight; blocks: m (the minimums, or empty);
                        // int8_strips: each weight row's sum
  int64_t group = 0;    // int4: group size; blocks: bits (4, 5 or 8)
  int64_t rows = 0;     // blocks_q8, *_strips: output rows (strips are padded to 16s)
  int64_t pad = 1;      // matmul.py's "name@p" (deterministic): calls of fewer rows padded
  torch::Tensor idx, side;  // blocks_q8: its outlier channels and their exact weights
  torch::Tensor m, bias_or_empty;  // blocks_q8: the minimums; it and f32_strips: the bias
};

// block_mm.cpp's block_mm_q8_out, called typed (no boxing): its C++ signature exactly.
using Q8Out = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   int64_t, int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, bool);

// out (=, or += with accumulate) x @ W.T (+ bias) through blocks_q8, into out's rows.
void q8_into(const Kernel& k, const torch::Tensor& x, const torch::Tensor& out,
             bool accumulate) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("pie_ctx_blocks::block_mm_q8_out", "")
                             .typed<Q8Out>();
  op.call(x, k.w, k.scale, k.m, k.group, k.rows, k.idx, k.side, k.bias_or_empty, out,
          accumulate);
}

struct LoraBlock {
  int64_t out_lo, out_hi, col_lo, col_hi;
  torch::Tensor b;  // B's block transposed: [col_hi - col_lo, out_hi - out_lo] bf16
};

struct LoraProj {
  torch::Tensor a;  // [R, in] bf16; undefined: the adapter leaves this projection alone
  std::vector<LoraBlock> blocks;
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  std::array<std::vector<Kernel>, 4> proj;  // qkv, o, gate_up, down; one kernel per bucket
};

// The rows of one adapter in this step's batch.
struct Group {
  const std::vector<std::array<LoraProj, 4>>* layers;
  std::vector<int64_t> rows;
};

const std::array<const char*, 4> PROJ_NAMES = {"pie::proj_qkv", "pie::proj_o",
                                               "pie::proj_gate_up", "pie::proj_down"};

Kernel make_kernel(py::tuple spec) {
  Kernel k;
  k.kind = spec[0].cast<int64_t>();
  k.w = spec[1].cast<torch::Tensor>();
  k.scale = spec[2].cast<torch::Tensor>();
  if (!spec[3].is_none()) k.bias = spec[3].cast<torch::Tensor>();
  if (!spec[4].is_none()) k.packed = torch::jit::toIValue(spec[4], c10::AnyType::get());
  k.group = spec[5].cast<int64_t>();
  if (spec.size() > 6) k.rows = spec[6].cast<int64_t>();
  if (spec.size() > 7) k.pad = spec[7].cast<int64_t>();
  if (spec.size() > 9) {
    k.idx = spec[8].cast<torch::Tensor>();
    k.side = spec[9].cast<torch::Tensor>();
  }
  TORCH_CHECK(k.kind >= MKL && k.kind <= F32_STRIPS, "decode step: unknown projection kernel");
  if (k.kind == BLOCKS_Q8) k.m = k.packed.toTensor();
  if (k.kind == BLOCKS_Q8 || k.kind == F32_STRIPS)
    k.bias_or_empty = k.bias.defined() ? k.bias.to(at::kFloat).contiguous()
                                       : torch::empty({0}, torch::kFloat32);
  return k;
}

torch::Tensor run_kernel(const Kernel& k, const torch::Tensor& x) {
  switch (k.kind) {
    case MKL:
      return at::linear(x, k.w, k.bias.defined() ? std::optional<at::Tensor>(k.bias)
                                                 : std::nullopt);
    case MM: {
      auto out = at::mm(k.w, x.t()).t().contiguous();
      return k.bias.defined() ? out.add_(k.bias) : out;
    }
    case ONEDNN: {
      static const auto op =
          c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
      torch::jit::Stack s{x, k.w, k.bias.defined() ? c10::IValue(k.bias) : c10::IValue(),
                          std::string("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          std::string("")};
      op.callBoxed(&s);
      return s[0].toTensor();
    }
    case INT_MM:         // matmul.py's _int8_linear over at::_int_mm ("int_mm"),
    case INT8_STRIPS: {  // or over strips_mm.cpp's int8_strips_mm ("int8_strips")
      auto qs = quantize_rows(x);
      auto acc = k.kind == INT_MM ? at::_int_mm(qs[0], k.w)
                                  : int8_strips_mm(qs[0], k.w, k.packed.toTensor(), k.rows);
      return dequantize_int32(acc, qs[1], k.scale,
                              k.bias.defined() ? k.bias : torch::empty({0}, x.options()));
    }
    case F32_STRIPS:  // matmul.py's "f32_strips": strips_mm.cpp's kernel
      return f32_strips_mm(x, k.w, k.bias_or_empty, k.rows);
    case FBGEMM: {  // matmul.py's _int8_fbgemm: the row's own max |x| / 127, zero point 128
      static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
          "quantized::linear_with_input_q_dq_qweight_dq_output_fp32", "");
      const float* p = x.data_ptr<float>();
      float mx = 0.f;
      for (int64_t i = 0; i < x.numel(); ++i) mx = std::max(mx, std::fabs(p[i]));
      const double scale = std::max(static_cast<double>(mx), 1e-12) / 127.0;
      torch::jit::Stack s{x, scale, int64_t{128}, k.packed};
      op.callBoxed(&s);
      return s[0].toTensor();
    }
    case INT4: {  // matmul.py's Int4Weight: bf16 activations, groupwise int4 weights
      auto out = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), k.w, k.group, k.scale)
                     .to(x.scalar_type());
      return k.bias.defined() ? out.add_(k.bias) : out;
    }
    case BLOCKS: {  // matmul.py's "blocks": block_mm.cpp's op over the GGUF's own blocks
      static const auto op =
          c10::Dispatcher::singleton().findSchemaOrThrow("pie_ctx_blocks::block_mm", "");
      torch::jit::Stack s{x, k.w, k.scale, k.packed, k.group};
      op.callBoxed(&s);
      auto out = s[0].toTensor();
      return k.bias.defined() ? out.add_(k.bias) : out;
    }
    case KQUANT: {  // matmul.py's "kquant" (group 0) and "kquant_q8" (1): kquant_mm.cpp's op
      static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
          "pie_ctx_kquants::kquant_mm_parts", "");
      torch::jit::Stack s{x, k.packed, k.scale, k.group != 0, int64_t{-1}};
      op.callBoxed(&s);
      auto out = s[0].toTensor();
      return k.bias.defined() ? out.add_(k.bias) : out;
    }
    case BLOCKS_Q8: {  // matmul.py's "blocks_q8": the blocks times int8-quantized activations
      static const auto op =
          c10::Dispatcher::singleton().findSchemaOrThrow("pie_ctx_blocks::block_mm_q8", "");
      torch::jit::Stack s{x, k.w, k.scale, k.packed, k.group, k.rows, k.idx, k.side};
      op.callBoxed(&s);
      auto out = s[0].toTensor();
      return k.bias.defined() ? out.add_(k.bias) : out;
    }
  }
  TORCH_CHECK(false, "decode step: unknown projection kernel");
}

// matmul.py's _padded: a call of fewer than k.pad rows runs on the rows and zero rows up
// to k.pad (the row-count-invariant calls of a deterministic choice), and keeps its own.
// Work (FMAs) below which a LoRA product runs on the calling thread (see DecodeStep::lora).
constexpr int64_t kParallelFmas = int64_t{1} << 21;

// parallel_for's grain for `tasks` tasks of `work` FMAs in all: every task in one chunk
// (one thread) below kParallelFmas, else one task a chunk.
int64_t grain_for(int64_t work, int64_t tasks) {
  return work < kParallelFmas ? std::max<int64_t>(tasks, 1) : 1;
}

torch::Tensor run_padded(const Kernel& k, const torch::Tensor& x) {
  const int64_t m = x.size(0);
  if (m >= k.pad) return run_kernel(k, x);
  auto full = torch::zeros({k.pad, x.size(1)}, x.options());
  full.narrow(0, 0, m).copy_(x);
  return run_kernel(k, full).narrow(0, 0, m);
}

}  // namespace

class DecodeStep {
 public:
  // chunk_rows: matmul.py's CHUNK_ROWS, the fewest rows of a call in the chunk bucket
  DecodeStep(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, int64_t chunk_rows)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps),
        chunk_rows_(chunk_rows) {}

  // specs: 4 lists (qkv, o, gate_up, down) of per-bucket tuples
  // (kind, weight, scale, bias or None, packed or None, group[, rows]).
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, py::list specs) {
    Layer l;
    l.input_norm = input_norm;
    l.post_norm = post_norm;
    TORCH_CHECK(specs.size() == 4, "decode step: four projections a layer");
    for (int p = 0; p < 4; ++p) {
      for (auto s : specs[p].cast<py::list>()) l.proj[p].push_back(make_kernel(s.cast<py::tuple>()));
      TORCH_CHECK(!l.proj[p].empty(), "decode step: a projection without kernels");
    }
    layers_.push_back(std::move(l));
  }

  // layers[i]: 4 entries (qkv, o, gate_up, down), each None or
  // (A bf16 [R, in], [(out_lo, out_hi, col_lo, col_hi, B's block transposed, bf16), ...]).
  void add_adapter(int64_t key, py::list layers) {
    TORCH_CHECK(static_cast<size_t>(layers.size()) == layers_.size(),
                "decode step: an adapter needs every layer");
    std::vector<std::array<LoraProj, 4>> out(layers.size());
    for (size_t i = 0; i < out.size(); ++i) {
      auto entries = layers[i].cast<py::list>();
      for (int p = 0; p < 4; ++p) {
        if (entries[p].is_none()) continue;
        auto pair = entries[p].cast<py::tuple>();
        LoraProj& lp = out[i][p];
        lp.a = pair[0].cast<torch::Tensor>();
        TORCH_CHECK(lp.a.scalar_type() == at::kBFloat16 && lp.a.is_contiguous(),
                    "decode step: adapter A must be contiguous bf16");
        for (auto b : pair[1].cast<py::list>()) {
          auto t = b.cast<py::tuple>();
          LoraBlock blk{t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(),
                        t[3].cast<int64_t>(), t[4].cast<torch::Tensor>()};
          TORCH_CHECK(blk.b.scalar_type() == at::kBFloat16 && blk.b.is_contiguous() &&
                      blk.b.size(0) == blk.col_hi - blk.col_lo &&
                      blk.b.size(1) == blk.out_hi - blk.out_lo,
                      "decode step: adapter B blocks must be contiguous bf16 [rank, out]");
          lp.blocks.push_back(std::move(blk));
        }
      }
    }
    adapters_[key] = std::move(out);
  }

  void drop_adapter(int64_t key) { adapters_.erase(key); }
  bool has_adapter(int64_t key) const { return adapters_.count(key) > 0; }

  // Every layer over x [T, hidden] (updated in place, and returned).
  //   cos, sin: [T, D]; pool: the KV pool, fp32, bf16 or int8 pages (write_kv and
  //   paged_attention read its dtype); pages, slots: [T] int64 write positions;
  //   tables, seq_start, cached: paged_attention's sequence tables;
  //   row_adapter: [T] int64 adapter keys (0 = base), or empty for a batch without any.
  torch::Tensor run(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor pool,
                    torch::Tensor pages, torch::Tensor slots, torch::Tensor tables,
                    torch::Tensor seq_start, torch::Tensor cached, torch::Tensor row_adapter) {
    RECORD_FUNCTION("pie::decode_step", std::vector<c10::IValue>());
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
                "decode step: x must be contiguous fp32 [T, hidden]");
    const int64_t T = x.size(0), D = head_dim_;
    const int64_t qd = heads_ * D, kvd = kv_heads_ * D;
    // matmul.py's ROW_BUCKETS (_bucket): 1 row, a batch, a chunk (chunk_rows and up)
    const size_t bucket = T <= 1 ? 0 : T < chunk_rows_ ? 1 : 2;
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    std::vector<Group> groups;
    if (row_adapter.numel()) {
      const int64_t* keys = row_adapter.data_ptr<int64_t>();
      std::unordered_map<int64_t, size_t> at;
      for (int64_t t = 0; t < T; ++t) {
        if (keys[t] == 0) continue;
        auto it = adapters_.find(keys[t]);
        TORCH_CHECK(it != adapters_.end(), "decode step: adapter ", keys[t], " not registered");
        auto [pos, fresh] = at.emplace(keys[t], groups.size());
        if (fresh) groups.push_back({&it->second, {}});
        groups[pos->second].rows.push_back(t);
      }
    }
    auto kernel = [&](const Layer& l, int p) -> const Kernel& {
      const auto& ks = l.proj[p];
      TORCH_CHECK(bucket < ks.size(), "decode step: no kernel for ", T, " rows");
      return ks[bucket];
    };
    auto project = [&](const Layer& l, int64_t layer, int p, const torch::Tensor& in) {
      torch::Tensor out;
      {
        RECORD_FUNCTION(PROJ_NAMES[p], std::vector<c10::IValue>());
        out = run_padded(kernel(l, p), in);
      }
      if (!groups.empty()) lora(layer, p, in, out, groups);
      return out;
    };
    // blocks_q8 (never padded: its rows are batch-invariant at any count) writes into the
    // step's buffers, allocated once a call (qkv, gate_up), and adds the o and down
    // projections straight into the residual x: x + v is the eager x.add_(v)'s bits. With
    // LoRA deltas the projection is formed first (x + (v + delta), as eagerly).
    auto direct = [&](const Kernel& k) { return k.kind == BLOCKS_Q8 && k.pad <= 1; };
    auto project_buf = [&](const Layer& l, int64_t layer, int p, const torch::Tensor& in,
                           torch::Tensor& buf) {
      const Kernel& k = kernel(l, p);
      if (!direct(k)) return project(l, layer, p, in);
      if (!buf.defined() || buf.size(1) != k.rows)
        buf = torch::empty({T, k.rows}, x.options());
      {
        RECORD_FUNCTION(PROJ_NAMES[p], std::vector<c10::IValue>());
        q8_into(k, in, buf, false);
      }
      if (!groups.empty()) lora(layer, p, in, buf, groups);
      return buf;
    };
    auto residual = [&](const Layer& l, int64_t layer, int p, const torch::Tensor& in) {
      const Kernel& k = kernel(l, p);
      if (direct(k) && groups.empty()) {
        RECORD_FUNCTION(PROJ_NAMES[p], std::vector<c10::IValue>());
        q8_into(k, in, x, true);
        return;
      }
      x.add_(project(l, layer, p, in));
    };
    torch::Tensor qkv_buf, gu_buf;
    for (int64_t i = 0; i < static_cast<int64_t>(layers_.size()); ++i) {
      const Layer& l = layers_[i];
      torch::Tensor h;
      {
        RECORD_FUNCTION("pie::rms_norm", std::vector<c10::IValue>());
        h = rms_norm(x, l.input_norm, eps_);
      }
      auto qkv = project_buf(l, i, 0, h, qkv_buf);  // [T, qd + 2 kvd]
      {
        RECORD_FUNCTION("pie::rope_", std::vector<c10::IValue>());
        rope_(qkv, cos, sin, heads_ + kv_heads_, D);
      }
      {
        RECORD_FUNCTION("pie::write_kv", std::vector<c10::IValue>());
        write_kv(pool, i, qkv.narrow(1, qd, 2 * kvd).view({T, 2, kv_heads_, D}), pages, slots);
      }
      torch::Tensor attn;
      {
        RECORD_FUNCTION("pie::paged_attention", std::vector<c10::IValue>());
        attn = paged_attention(qkv.narrow(1, 0, qd).view({T, heads_, D}), pool, i, tables,
                               seq_start, cached, scale);
      }
      // the next layer's keys and values, fetched while this layer's projections run
      if (i + 1 < static_cast<int64_t>(layers_.size())) {
        RECORD_FUNCTION("pie::prefetch_paged_kv", std::vector<c10::IValue>());
        prefetch_paged_kv(pool, i + 1, tables, seq_start, cached);
      }
      residual(l, i, 1, attn);
      {
        RECORD_FUNCTION("pie::rms_norm", std::vector<c10::IValue>());
        h = rms_norm(x, l.post_norm, eps_);
      }
      auto gu = project_buf(l, i, 2, h, gu_buf);
      torch::Tensor inner;
      {
        RECORD_FUNCTION("pie::silu_mul", std::vector<c10::IValue>());
        inner = silu_mul(gu);
      }
      residual(l, i, 3, inner);
    }
    return x;
  }

 private:
  // out[rows of each group] += (x[rows] @ A.T) @ B.T, per target block; x and out fp32.
  void lora(int64_t layer, int p, const torch::Tensor& x, torch::Tensor& out,
            const std::vector<Group>& groups) const {
    RECORD_FUNCTION("pie::lora_grouped", std::vector<c10::IValue>());
    TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                x.stride(1) == 1 && out.stride(1) == 1, "decode step: LoRA needs fp32 rows");
    const int64_t in = x.size(1);
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    // tasks of the first product: (group, row of A); its results: xa[group][row i][r]
    struct ATask { const LoraProj* lp; const Group* g; int64_t r; size_t off; };
    std::vector<ATask> a_tasks;
    std::vector<size_t> xa_off(groups.size());
    size_t total = 0;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const LoraProj& lp = (*groups[gi].layers)[layer][p];
      xa_off[gi] = total;
      if (!lp.a.defined()) continue;
      const int64_t R = lp.a.size(0);
      for (int64_t r = 0; r < R; ++r) a_tasks.push_back({&lp, &groups[gi], r, total});
      total += R * groups[gi].rows.size();
    }
    if (a_tasks.empty()) return;
    std::vector<float> xa(total);
    // A step's deltas are small (8 rows on one rank-16 adapter: ~0.2M FMAs a projection)
    // against a parallel region's fork and join (~50 us here: the deltas of 8 rows on one
    // adapter took 132 us a call on two threads, 32 us on one), so a product runs on the
    // threads only past kParallelFmas of work.
    int64_t a_work = 0;
    for (const ATask& t : a_tasks) a_work += static_cast<int64_t>(t.g->rows.size()) * in;
    const int64_t a_grain = grain_for(a_work, static_cast<int64_t>(a_tasks.size()));
    at::parallel_for(0, static_cast<int64_t>(a_tasks.size()), a_grain, [&](int64_t b, int64_t e) {
      for (int64_t ti = b; ti < e; ++ti) {
        const ATask& t = a_tasks[ti];
        const int64_t R = t.lp->a.size(0);
        const uint16_t* arow =
            reinterpret_cast<const uint16_t*>(t.lp->a.data_ptr<at::BFloat16>()) + t.r * in;
        for (size_t j = 0; j < t.g->rows.size(); ++j)
          xa[t.off + j * R + t.r] = dot_bf16(xp + t.g->rows[j] * xs, arow, in);
      }
    });
    // tasks of the second product: (group, block, a chunk of its output rows)
    constexpr int64_t CHUNK = 64;
    struct BTask { const LoraBlock* blk; const Group* g; int64_t R; int64_t lo, hi; size_t off; };
    std::vector<BTask> b_tasks;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const LoraProj& lp = (*groups[gi].layers)[layer][p];
      if (!lp.a.defined()) continue;
      for (const LoraBlock& blk : lp.blocks)
        for (int64_t lo = 0; lo < blk.out_hi - blk.out_lo; lo += CHUNK)
          b_tasks.push_back({&blk, &groups[gi], lp.a.size(0), lo,
                             std::min(lo + CHUNK, blk.out_hi - blk.out_lo), xa_off[gi]});
    }
    // B is stored transposed ([w, out]): 16 outputs at a time, one FMA per rank column
    int64_t b_work = 0;
    for (const BTask& t : b_tasks)
      b_work += static_cast<int64_t>(t.g->rows.size()) * (t.hi - t.lo) * t.R;
    const int64_t b_grain = grain_for(b_work, static_cast<int64_t>(b_tasks.size()));
    at::parallel_for(0, static_cast<int64_t>(b_tasks.size()), b_grain, [&](int64_t b, int64_t e) {
      for (int64_t ti = b; ti < e; ++ti) {
        const BTask& t = b_tasks[ti];
        const int64_t w = t.blk->col_hi - t.blk->col_lo;
        const int64_t width = t.blk->out_hi - t.blk->out_lo;
        const uint16_t* bt = reinterpret_cast<const uint16_t*>(t.blk->b.data_ptr<at::BFloat16>());
        for (size_t j = 0; j < t.g->rows.size(); ++j) {
          const float* v = xa.data() + t.off + j * t.R + t.blk->col_lo;
          float* dst = op + t.g->rows[j] * os + t.blk->out_lo;
          int64_t o = t.lo;
          for (; o + 16 <= t.hi; o += 16) {
            f16v acc{};
            for (int64_t c = 0; c < w; ++c) acc += load_bf16(bt + c * width + o) * v[c];
            const f16v sum = loadf(dst + o) + acc;
            std::memcpy(dst + o, &sum, sizeof sum);
          }
          for (; o < t.hi; ++o) {
            float acc = 0.f;
            for (int64_t c = 0; c < w; ++c) acc += bf16(bt[c * width + o]) * v[c];
            dst[o] += acc;
          }
        }
      }
    });
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  int64_t chunk_rows_;
  std::vector<Layer> layers_;
  std::unordered_map<int64_t, std::vector<std::array<LoraProj, 4>>> adapters_;
};

void register_decode_step(py::module_& m) {
  // kernel name (runtime/model/matmul.py's) -> Kind: the one table of the numbers
  // fused_step.py hands add_layer. int_mm_kn is int_mm on a transposed copy of W (the
  // layout is in the weight's strides); kquant_q8 is KQUANT with group 1.
  py::dict kinds;
  const std::pair<const char*, Kind> names[] = {
      {"mkl", MKL}, {"mm", MM}, {"onednn", ONEDNN}, {"int_mm", INT_MM}, {"int_mm_kn", INT_MM},
      {"fbgemm", FBGEMM}, {"int4pack", INT4}, {"blocks", BLOCKS}, {"blocks_q8", BLOCKS_Q8},
      {"kquant", KQUANT}, {"kquant_q8", KQUANT}, {"int8_strips", INT8_STRIPS},
      {"f32_strips", F32_STRIPS}};
  for (const auto& [name, kind] : names) kinds[name] = static_cast<int64_t>(kind);
  m.attr("STEP_KINDS") = kinds;
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init<int64_t, int64_t, int64_t, double, int64_t>())
      .def("add_layer", &DecodeStep::add_layer)
      .def("add_adapter", &DecodeStep::add_adapter)
      .def("drop_adapter", &DecodeStep::drop_adapter)
      .def("has_adapter", &DecodeStep::has_adapter)
      .def("run", &DecodeStep::run, py::call_guard<py::gil_scoped_release>());
}
