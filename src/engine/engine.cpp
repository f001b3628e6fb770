// The generation engine (samebits/engine.hpp says why it is shaped so). One step: admit waiting
// requests whose samples all find a free slot; pack decode rows, then prompt chunks, under the
// token budget; run the chain against the cache; draw a token for every sequence whose last row
// ends its prompt or is a decode row, report its fused LM-head logprob, and retire what finished.
#include "samebits/engine.hpp"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <set>
#include <tuple>

#include <fmt/format.h>

#include "core/captured_graph.hpp"
#include "model/decode_graphs.hpp"
#include "samebits/device.hpp"
#include "samebits/error.hpp"

namespace samebits {

struct Engine::Sample {
  int64_t index = 0, slot = -1;
  int64_t cached = 0;            // tokens of prompt + generated held in the slot
  bool waits_for_prefix = false; // shares the prompt's prefill: its slot gets the prompt by copy
  bool done = false;
  std::vector<int32_t> tokens;   // generated (applied)
  std::vector<double> logprobs, sampling_logprobs;
  int64_t in_flight = 0;         // tokens drawn by launched steps and not applied yet (1; 2 for a moment)
  int32_t fed_row = -1;          // the draw of the latest launch that holds the newest of them
  int64_t drawn() const { return int64_t(tokens.size()) + in_flight; }
};

// A launched step: whose draws are which, and the draws (a graph replay's once collected).
struct Engine::InFlight {
  std::vector<std::pair<std::shared_ptr<Request>, Sample*>> draws;
  std::optional<DecodeGraphs::Launched> graph;
  Chain::RowDraws drawn;
};

struct Engine::Request {
  int64_t id = 0;
  GenerationRequest req;
  std::vector<Sample> samples;
  int64_t prompt_len() const { return int64_t(req.prompt.size()); }
  // Tokens the slot must hold before the sample's next row: the prompt, and after a preemption its
  // generated tokens but the last (which the next decode row feeds).
  int64_t prefill_target(const Sample& s) const { return prompt_len() + (s.drawn() == 0 ? 0 : s.drawn() - 1); }
  bool decoding(const Sample& s) const { return s.drawn() > 0 && s.cached == prefill_target(s); }
  // A decoding sample with tokens still to draw (one that has drawn max_new_tokens, the last not yet
  // applied, is ending).
  bool draws_on(const Sample& s) const { return !s.done && decoding(s) && s.drawn() < req.sampling.max_new_tokens; }
  bool prefilling(const Sample& s) const { return !s.done && !s.waits_for_prefix && s.cached < prefill_target(s); }
  // Samples still to finish: each needs a slot (a preempted request's finished ones need none).
  int64_t unfinished() const {
    return int64_t(std::count_if(samples.begin(), samples.end(), [](const Sample& s) { return !s.done; }));
  }
};

namespace {

int64_t context_of(const Model& model, const EngineOptions& o) {
  const int64_t max_pos = model.config().rope.max_position;
  if (o.max_context < 0) throw Error("Engine", "max_context", "must be ≥ 0 (0: min(max_position_embeddings, 4096))");
  return o.max_context == 0 ? std::min<int64_t>(max_pos, 4096) : std::min(o.max_context, max_pos);
}

// The pool's pages: kv_pages, or what kv_memory_bytes holds, or every slot's max_context.
int64_t pool_pages(const Model& model, const EngineOptions& o, int64_t context, DType act) {
  const ModelConfig& c = model.config();
  const int64_t ps = std::max<int64_t>(o.page_size, 1), slots = std::max<int64_t>(o.max_slots, 1);
  if (o.kv_pages < 0 || o.kv_memory_bytes < 0) throw Error("Engine", "kv_pages", "must be ≥ 0");
  if (o.kv_pages > 0 && o.kv_memory_bytes > 0) throw Error("Engine", "kv_pages", "give kv_pages or kv_memory_bytes, not both");
  if (o.kv_pages > 0) return o.kv_pages;
  const int64_t page_bytes = c.num_layers * 2 * ps * c.num_kv_heads * c.head_dim * dtype_size(act);
  if (o.kv_memory_bytes > 0) {
    const int64_t pages = o.kv_memory_bytes / page_bytes;
    if (pages < 1)
      throw Error("Engine", "kv_memory_bytes", fmt::format("{} bytes hold no page ({} bytes a page of {} tokens)",
                                                           o.kv_memory_bytes, page_bytes, ps));
    return pages;
  }
  const int64_t every_slot = slots * ((context + ps - 1) / ps);
  if (o.backend != Backend::cuda) return every_slot;
  // On the GPU: no more than its free memory holds after a reserve for a step's activations (two
  // layers' over max_batch_tokens rows: a cached step frees each layer's as the next begins) and the
  // logits of the drawing rows, and 5% of the card.
  size_t free = 0, total = 0;
  device_memory_info(o.backend, &free, &total);
  const int64_t step = std::max<int64_t>(o.max_batch_tokens, 1) * 2 *
                           (8 * c.hidden_size + 4 * c.intermediate_size + 2 * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim) *
                           dtype_size(act) +
                       slots * c.vocab_size * 8;
  const int64_t spare = int64_t(free) - step - int64_t(total / 20);
  const int64_t fits = spare > 0 ? spare / page_bytes : 0;
  if (fits < 1)
    throw Error("Engine", "kv_memory_bytes", fmt::format("the GPU's free memory ({:.1f} GiB) leaves no room for a KV pool "
                                                         "after a step's activations ({:.1f} GiB): lower max_batch_tokens",
                                                         double(free) / (1 << 30), double(step) / (1 << 30)));
  return std::min(every_slot, fits);
}

Context context_for(Backend backend, void* stream) {
  Context ctx;
  ctx.backend = backend;
  ctx.stream = stream;
  return ctx;
}

}  // namespace

Engine::Engine(const Model& model, EngineOptions options)
    : model_(model),
      options_(options),
      context_(context_of(model, options)),
      stream_(options.backend),
      chain_(model, context_for(options.backend, stream_.get())),
      cache_(KvCache::paged(model.config(), std::max<int64_t>(options.max_slots, 1), context_,
                            pool_pages(model, options, context_, chain_.act_dtype()),
                            std::max<int64_t>(options.page_size, 1), chain_.act_dtype(), options.backend)) {
  if (options.page_size < 1) throw Error("Engine", "page_size", fmt::format("must be at least 1, got {}", options.page_size));
  if (options.max_slots < 1) throw Error("Engine", "max_slots", fmt::format("must be at least 1, got {}", options.max_slots));
  if (options.max_batch_tokens < 1)
    throw Error("Engine", "max_batch_tokens", fmt::format("must be at least 1, got {}", options.max_batch_tokens));
  for (int64_t s = options.max_slots - 1; s >= 0; --s) free_slots_.push_back(s);  // the lowest slot first
  if (options.cuda_graphs && DecodeGraphs::available(chain_))
    graphs_ = std::make_unique<DecodeGraphs>(chain_, cache_, options.max_slots);
}

Engine::~Engine() = default;

int64_t Engine::captured_graphs() const { return graphs_ ? int64_t(graphs_->captured()) : 0; }

int64_t Engine::submit(GenerationRequest request) {
  const int64_t id = next_id_++;
  const std::string op = fmt::format("generate: request {}", id);
  const ModelConfig& c = model_.config();
  try {
    const auto& p = request.prompt;
    if (p.empty()) throw Error(op, "prompt", "is empty (a prompt needs at least one token)");
    for (size_t i = 0; i < p.size(); ++i)
      if (p[i] < 0 || p[i] >= c.vocab_size)
        throw Error(op, "prompt", fmt::format("token id {} at {} is outside the vocab [0, {})", p[i], i, c.vocab_size));
    request.sampling.validate(op, c.vocab_size);
    const int64_t need = int64_t(p.size()) + request.sampling.max_new_tokens;
    if (need > context_)
      throw Error(op, "max_new_tokens",
                  fmt::format("prompt ({}) + max_new_tokens ({}) = {} tokens, more than a slot holds ({}: the model's "
                              "max_position_embeddings {}, the engine's max_context)",
                              p.size(), request.sampling.max_new_tokens, need, context_, c.rope.max_position));
    if (request.sampling.n > options_.max_slots)
      throw Error(op, "n", fmt::format("{} samples, more than the engine's {} slots", request.sampling.n, options_.max_slots));
    const int64_t pages = request.sampling.n * cache_.pages_for(need);
    if (pages > cache_.pages())
      throw Error(op, "n", fmt::format("{} samples of up to {} tokens need {} KV pages, the pool has {}",
                                       request.sampling.n, need, pages, cache_.pages()));
  } catch (const Error& e) {
    Completion failed;
    failed.request = id;
    failed.finish_reason = "error";
    failed.error = e.what();
    done_.push_back(std::move(failed));
    return id;
  }
  auto r = std::make_shared<Request>();
  r->id = id;
  r->req = std::move(request);
  for (int64_t j = 0; j < r->req.sampling.n; ++j) {
    Sample s;
    s.index = j;
    s.waits_for_prefix = options_.share_prefix && j > 0;
    r->samples.push_back(std::move(s));
  }
  waiting_.push_back(std::move(r));
  return id;
}

void Engine::admit() {
  // A slot for every sample still to finish (a preempted request's finished samples need none).
  while (!waiting_.empty() && int64_t(free_slots_.size()) >= waiting_.front()->unfinished()) {
    auto r = waiting_.front();
    waiting_.pop_front();
    for (Sample& s : r->samples)
      if (!s.done) {
        s.slot = free_slots_.back();
        free_slots_.pop_back();
      }
    running_.push_back(std::move(r));
  }
}

void Engine::release(Sample& s) {
  cache_.reset(s.slot);
  free_slots_.insert(std::upper_bound(free_slots_.begin(), free_slots_.end(), s.slot, std::greater<int64_t>()), s.slot);
  s.slot = -1;
}

void Engine::finish(Sample& s, const char* reason) {
  s.done = true;
  release(s);
  Completion c;
  c.sample = s.index;
  c.tokens = std::move(s.tokens);
  c.logprobs = std::move(s.logprobs);
  c.sampling_logprobs = std::move(s.sampling_logprobs);
  c.finish_reason = reason;
  done_.push_back(std::move(c));
}

bool Engine::preempt_latest_after(size_t index) {
  if (running_.size() <= index + 1) return false;
  auto r = running_.back();
  running_.pop_back();
  // Back to the queue's front: its slots and pages go, its samples will recompute what they had
  // (prefill = decode, bit for bit) and draw on from the same counters.
  const bool none_drawn = std::all_of(r->samples.begin(), r->samples.end(), [](const Sample& s) { return s.tokens.empty(); });
  for (Sample& s : r->samples) {
    if (s.done) continue;
    release(s);
    s.cached = 0;
    s.waits_for_prefix = none_drawn && options_.share_prefix && s.index > 0;
  }
  if (std::any_of(r->samples.begin(), r->samples.end(), [](const Sample& s) { return s.done; })) ++preempted_with_done_;
  waiting_.push_front(std::move(r));
  ++preemptions_;
  return true;
}

int64_t Engine::next_row_pages(const Sample& s) const {
  return cache_.pages_for(s.cached + 1) - int64_t(cache_.block_table(s.slot).size());
}

bool Engine::decode_only_ahead() const {
  if (!options_.overlap_steps) return false;
  // A request that could be admitted now, a prompt to prefill, or a page to take from another
  // request: the next step needs the state the draws in flight leave (it waits for them).
  if (!waiting_.empty() && int64_t(free_slots_.size()) >= waiting_.front()->unfinished()) return false;
  int64_t rows = 0, need = 0;
  for (const auto& rp : running_)
    for (const Sample& s : rp->samples) {
      if (s.done) continue;
      if (s.waits_for_prefix || rp->prefilling(s) || !rp->decoding(s)) return false;
      if (!rp->draws_on(s)) continue;
      ++rows;
      need += next_row_pages(s);
    }
  return rows > 0 && rows <= options_.max_batch_tokens && need <= cache_.free_pages();
}

void Engine::settle(InFlight& f) {
  if (!f.graph) return;
  f.drawn = graphs_->collect(*f.graph);
  f.graph.reset();
}

void Engine::settle_in_flight() {
  if (in_flight_) settle(*in_flight_);
}

void Engine::apply_in_flight() {
  if (!in_flight_) return;
  settle(*in_flight_);  // may throw (a device error): the step stays in flight, nothing applied
  apply(std::move(in_flight_));
}

void Engine::apply(std::unique_ptr<InFlight> f) {
  settle(*f);
  for (auto& [r, s] : f->draws) --s->in_flight;  // first, all: no sample is left counting this step
  for (size_t i = 0; i < f->draws.size(); ++i) {
    const Request& r = *f->draws[i].first;
    Sample& s = *f->draws[i].second;
    if (s.done) continue;  // it ended at the step before (this token was drawn past its end: dropped)
    if (f->drawn.tokens[i] < 0) {  // the model's logits hold NaN / Inf here: this sample ends, the rest run on
      const std::string what = fmt::format("request {} sample {}: the model's logits at position {} hold NaN or Inf",
                                            r.id, s.index, r.prompt_len() + int64_t(s.tokens.size()));
      const size_t before = done_.size();
      finish(s, "error");
      done_[before].request = r.id;
      done_[before].error = what;
      continue;
    }
    const int32_t token = f->drawn.tokens[i];
    s.tokens.push_back(token);
    s.logprobs.push_back(f->drawn.logprobs[i]);
    s.sampling_logprobs.push_back(f->drawn.sampling_logprobs[i]);
    ++generated_;
    const auto& stop = r.req.sampling.stop_token_ids;
    const bool stopped = std::find(stop.begin(), stop.end(), token) != stop.end();
    const bool full = int64_t(s.tokens.size()) >= r.req.sampling.max_new_tokens;
    if (stopped || full) {
      const size_t before = done_.size();
      finish(s, stopped ? "stop" : "length");
      done_[before].request = r.id;
    }
  }
  running_.erase(std::remove_if(running_.begin(), running_.end(),
                                [](const std::shared_ptr<Request>& r) {
                                  return std::all_of(r->samples.begin(), r->samples.end(),
                                                     [](const Sample& s) { return s.done; });
                                }),
                 running_.end());
}

bool Engine::step() {
  // The draws in flight are applied after this step is launched when it can do without them (every
  // row a decode row, its token taken from the step in flight); else first.
  const int64_t generated_before = generated_;
  if (in_flight_ && !decode_only_ahead()) apply_in_flight();
  admit();
  if (running_.empty()) {
    if (!waiting_.empty())  // never drop a request: submit checks it fits an empty engine
      throw Error("Engine", "request " + std::to_string(waiting_.front()->id), "cannot be admitted (cannot happen)");
    if (progress_ && generated_ != generated_before) progress_(generated_, steps_);
    return false;
  }
  // The batch: decode rows first (one a sample), then prompt chunks, within the token budget and
  // the pages the cache can give. A decode row that finds no page preempts the latest other request.
  struct Part {
    std::shared_ptr<Request> r;
    Sample* s;
    bool draws_first;  // its last row ends the prompt: draw the first token (of every sharing sample)
  };
  std::vector<Part> parts;
  ChainBatch b;
  std::vector<int32_t> fed;  // a row's token drawn by the step in flight: that step's draw; else −1
  int64_t budget = options_.max_batch_tokens;
  auto add = [&](const std::shared_ptr<Request>& rp, Sample& s, int64_t len) {
    const Request& r = *rp;
    const int64_t P = r.prompt_len();
    b.seqs.push_back({b.rows(), len, s.slot, s.cached});
    for (int64_t i = 0; i < len; ++i) {
      const int64_t pos = s.cached + i;
      const bool in_flight = pos >= P && pos - P >= int64_t(s.tokens.size());
      b.tokens.push_back(pos < P ? r.req.prompt[size_t(pos)] : in_flight ? 0 : s.tokens[size_t(pos - P)]);
      fed.push_back(in_flight ? s.fed_row : -1);
      b.positions.push_back(int32_t(pos));
      b.targets.push_back(-100);
      b.loss_mask.push_back(0);
    }
    parts.push_back({rp, &s, s.drawn() == 0 && s.cached + len == P});
    budget -= len;
  };
  // Decode rows, request by request in admission order: a request whose rows need pages the pool
  // lacks preempts the latest requests after it (which have added nothing yet), else waits itself.
  for (size_t i = 0; i < running_.size(); ++i) {
    const std::shared_ptr<Request> rp = running_[i];
    Request& r = *rp;
    std::vector<Sample*> rows_of_r;
    int64_t need = 0;
    for (Sample& s : r.samples)
      if (r.draws_on(s) && budget - int64_t(rows_of_r.size()) > 0) {
        rows_of_r.push_back(&s);
        need += next_row_pages(s);
      }
    while (cache_.free_pages() < need && preempt_latest_after(i)) {
    }
    if (cache_.free_pages() < need) continue;  // waits for pages (those ahead of it finish first)
    for (Sample* s : rows_of_r) {
      cache_.reserve(s->slot, s->cached + 1);
      add(rp, *s, 1);
    }
  }
  // Prompt chunks (and recomputation after a preemption) in what remains of the budget and the
  // pool. A chunk that ends a shared prompt also holds back a page for each sample's copy of the
  // prompt's last partial page.
  int64_t promised = 0;
  for (const std::shared_ptr<Request>& rp : running_) {
    Request& r = *rp;
    for (Sample& s : r.samples) {
      if (!r.prefilling(s) || budget <= 0) continue;
      const int64_t held = int64_t(cache_.block_table(s.slot).size()), free = cache_.free_pages() - promised;
      int64_t len = std::min({budget, r.prefill_target(s) - s.cached, (held + free) * cache_.page_size() - s.cached});
      if (len <= 0) continue;
      int64_t copies = 0;
      if (s.tokens.empty() && s.cached + len == r.prompt_len() && r.prompt_len() % cache_.page_size() != 0)
        for (const Sample& other : r.samples) copies += other.waits_for_prefix ? 1 : 0;
      if (copies > 0 && free - (cache_.pages_for(s.cached + len) - held) < copies) --len;  // end the prompt later
      if (len <= 0 || !cache_.reserve(s.slot, s.cached + len)) continue;
      if (s.tokens.empty() && s.cached + len == r.prompt_len()) promised += copies;
      add(rp, s, len);
    }
  }
  if (parts.empty()) {  // every running request waits for pages: the latest gives way
    if (preempt_latest_after(0)) return true;
    throw Error("Engine", "kv_pages", "the first running request cannot get a page (cannot happen: submit checks)");
  }
  // What draws, settled before anything runs (a step that fails leaves the samples as they were): a
  // decode row, or the end of a prompt (for the sample itself, and for every sample sharing the
  // prompt). Each draw's token and its logprob come from one LM-head GEMM over the drawing rows and
  // the sampling op, on the chain's backend (no logits come to the host).
  std::vector<char> decode(parts.size());
  for (size_t k = 0; k < parts.size(); ++k) decode[k] = parts[k].r->decoding(*parts[k].s);
  struct Draw {
    std::shared_ptr<Request> r;
    Sample* s;
    int64_t row;
  };
  std::vector<Draw> draws;
  for (size_t k = 0; k < parts.size(); ++k) {
    const Part& p = parts[k];
    if (!decode[k] && !p.draws_first) continue;
    const int64_t row = b.seqs[k].row + b.seqs[k].len - 1;
    draws.push_back({p.r, p.s, row});
    if (p.draws_first)
      for (Sample& other : p.r->samples)
        if (other.waits_for_prefix) draws.push_back({p.r, &other, row});
  }
  std::vector<int64_t> draw_rows;
  std::vector<double> params;
  for (const Draw& d : draws) {
    const SamplingParams& sp = d.r->req.sampling;
    const int64_t position = d.r->prompt_len() + d.s->drawn();
    draw_rows.push_back(d.row);
    const auto row = sampling_row(sp, sampling_uniform(sp.seed, d.s->index, position));
    params.insert(params.end(), row.begin(), row.end());
  }
  // Tokens still on the device are read from the step in flight there (a graph replay feeding a
  // graph replay); anywhere else they are waited for and written into the batch.
  const bool any_fed = std::any_of(fed.begin(), fed.end(), [](int32_t j) { return j >= 0; });
  auto fed_on_host = [&] {
    settle_in_flight();
    for (size_t row = 0; row < fed.size(); ++row)
      if (fed[row] >= 0) b.tokens[row] = std::max(in_flight_->drawn.tokens[size_t(fed[row])], 0);  // < 0: dropped
  };
  // A decode step (every row a sample's next token) replays its bucket's CUDA graph: forward, LM
  // head and draw in one launch. Any other step runs eagerly: the forward (logits of the drawing
  // rows only), then the draws. A step that cannot be captured runs eagerly, and so does every
  // later one (graphs_off_reason() says why).
  Chain::RowDraws drawn;
  std::optional<DecodeGraphs::Launched> launched;
  bool graphed = graphs_ && std::all_of(decode.begin(), decode.end(), [](char d) { return d != 0; }) && graphs_->takes(b);
  if (graphed) {
    const bool on_device = any_fed && in_flight_->graph.has_value();
    if (any_fed && !on_device) fed_on_host();
    launched = graphs_->launch(b, params, on_device ? fed : std::vector<int32_t>{});
    if (!launched) {
      graphs_off_reason_ = graphs_->capture_error();
      settle_in_flight();  // before the graphs go: the tokens in flight are read from them
      graphs_.reset();
      graphed = false;
    }
  }
  {  // the engine's device work (eager steps, prompt copies) on its stream; not the progress callback's
    const DeviceStreamScope on(stream_.get());
    if (!graphed) {
      if (any_fed) fed_on_host();
      const ChainForward f = chain_.forward_cached(b, cache_, nullptr, /*score_rows=*/false);
      drawn = chain_.sample_rows(f, draw_rows, params);
    }
    graph_steps_ += graphed ? 1 : 0;
    // Each sequence's rows are in its slot now; a prompt's last chunk hands the prompt's keys and
    // values to the samples sharing it.
    for (size_t k = 0; k < parts.size(); ++k) {
      const Part& p = parts[k];
      p.s->cached += b.seqs[k].len;
      if (p.draws_first)
        for (Sample& other : p.r->samples)
          if (other.waits_for_prefix) {
            if (!cache_.copy_prefix(p.s->slot, other.slot, p.r->prompt_len()))  // its page was held back above
              throw Error("Engine", "kv_pages", "no page to share a prompt (cannot happen)");
            other.cached = p.r->prompt_len();
            other.waits_for_prefix = false;
          }
    }
  }
  auto launched_now = std::make_unique<InFlight>();
  launched_now->graph = launched;
  launched_now->drawn = std::move(drawn);
  for (size_t i = 0; i < draws.size(); ++i) {
    launched_now->draws.emplace_back(draws[i].r, draws[i].s);
    ++draws[i].s->in_flight;
    draws[i].s->fed_row = int32_t(i);
  }
  ++steps_;
  overlapped_steps_ += in_flight_ ? 1 : 0;
  // The step before this one's draws are applied (waited for here, while this one runs); this one
  // is in flight from now on, whatever that throws (its samples count it).
  std::unique_ptr<InFlight> before = std::move(in_flight_);
  in_flight_ = std::move(launched_now);
  if (before) apply(std::move(before));
  if (!options_.overlap_steps) apply_in_flight();
  if (progress_) progress_(generated_, steps_);  // last: a callback that throws leaves the engine whole
  return true;
}

std::vector<Completion> Engine::run() {
  while (step()) {
  }
  std::vector<Completion> out = std::move(done_);
  done_.clear();
  std::sort(out.begin(), out.end(),
            [](const Completion& a, const Completion& b) { return std::tie(a.request, a.sample) < std::tie(b.request, b.sample); });
  return out;
}

std::vector<Completion> generate(const Model& model, const std::vector<GenerationRequest>& requests,
                                 const EngineOptions& options) {
  Engine engine(model, options);
  for (const GenerationRequest& r : requests) engine.submit(r);
  return engine.run();
}

}  // namespace samebits
