// gloo behind a C interface: a full-mesh context built over our rendezvous store, and the collectives.
// Every gloo call sits in a try/catch; exceptions never cross into C, they become result codes + text.
#include <cstdio>
#include <cstring>
#include <pthread.h>
#include <sched.h>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "comm/gloo.h"

namespace {

// Thrown by the store adapter so the store's own status (timeout, Ctrl-C) survives gloo.
struct StoreError : std::runtime_error {
  dlua_status_t status;
  StoreError(dlua_status_t s, const std::string &m) : std::runtime_error(m), status(s) {}
};

// gloo's rendezvous Store over a dlua_store_t connection, keys under "<prefix>/gloo/".
class DluaStore : public gloo::rendezvous::Store {
 public:
  DluaStore(dlua_store_t *s, const std::string &prefix, int64_t timeout_ms)
      : s_(s), prefix_(prefix + "/gloo/"), timeout_ms_(timeout_ms) {}

  void set(const std::string &key, const std::vector<char> &data) override {
    std::string k = prefix_ + key;
    check(dlua_store_set(s_, k.c_str(), data.data(), data.size()));
  }

  std::vector<char> get(const std::string &key) override {
    std::string k = prefix_ + key;
    void *v = nullptr;
    size_t n = 0;
    check(dlua_store_get(s_, k.c_str(), timeout_ms_, &v, &n));
    std::vector<char> out((char *)v, (char *)v + n);
    dlua_store_free_value(v);
    return out;
  }

  void wait(const std::vector<std::string> &keys) override { wait(keys, std::chrono::milliseconds(timeout_ms_)); }

  void wait(const std::vector<std::string> &keys, const std::chrono::milliseconds &timeout) override {
    std::vector<std::string> full;
    std::vector<const char *> ptrs;
    full.reserve(keys.size());
    for (const auto &k : keys) full.push_back(prefix_ + k);
    for (const auto &k : full) ptrs.push_back(k.c_str());
    int64_t ms = timeout.count() > 0 ? (int64_t)timeout.count() : timeout_ms_;
    check(dlua_store_wait(s_, ptrs.data(), (int)ptrs.size(), ms));
  }

 private:
  static void check(dlua_status_t s) {
    if (s != DLUA_OK) throw StoreError(s, dlua_last_error());
  }
  dlua_store_t *s_;
  std::string prefix_;
  int64_t timeout_ms_;
};

// Elements of a given width: gloo's templates only need sizeof(T).
template <size_t N>
struct Elem {
  char b[N];
};

dlua_pg_result_t fail(char *err, size_t errlen, dlua_pg_result_t r, const char *msg) {
  if (err && errlen) snprintf(err, errlen, "%s", msg);
  return r;
}

// Runs f, mapping every exception to a result code; gloo's own timeouts read "Timed out waiting".
template <typename F>
dlua_pg_result_t guarded(char *err, size_t errlen, F &&f) {
  try {
    f();
    return DLUA_PG_OK;
  } catch (const gloo::IoException &e) {
    const char *m = e.what();
    return fail(err, errlen, strstr(m, "Timed out") ? DLUA_PG_TIMEOUT : DLUA_PG_PEER_LOST, m);
  } catch (const std::exception &e) {
    return fail(err, errlen, DLUA_PG_FAILED, e.what());
  } catch (...) {
    return fail(err, errlen, DLUA_PG_FAILED, "unknown C++ exception");
  }
}

std::chrono::milliseconds ms(int64_t t) { return std::chrono::milliseconds(t > 0 ? t : 1); }

// While alive, the calling thread runs SCHED_BATCH, so threads it starts do too. For gloo's event
// loop: a SCHED_BATCH thread never preempts another when it wakes. Otherwise, on a busy CPU, its
// wakeup (a peer's bytes arriving) preempts our comm thread inside gloo while that holds the pair's
// lock, and the loop spins on the still-readable socket (its handler only try-locks) for a whole
// time slice: ~4 ms for an all-reduce that takes 0.1 ms (bench/allreduce, 2 busy cores). Changing
// between SCHED_OTHER and SCHED_BATCH needs no privilege; a failure leaves the policy as it was.
struct BatchPolicy {
  int policy = SCHED_OTHER;
  struct sched_param param = {};
  bool changed = false;
  BatchPolicy() {
    struct sched_param zero = {};
    changed = pthread_getschedparam(pthread_self(), &policy, &param) == 0 && policy == SCHED_OTHER &&
              pthread_setschedparam(pthread_self(), SCHED_BATCH, &zero) == 0;
  }
  ~BatchPolicy() {
    if (changed) pthread_setschedparam(pthread_self(), policy, &param);
  }
};

}  // namespace

struct dlua_gloo {
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::rendezvous::Context> context;
};

// gloo checks message sizes on its own event-loop thread, where nothing of ours can catch: a
// rank that posts a different size than its peer (a user error: the ranks disagree on a tensor's
// shape) ends in std::terminate. Say what happened and exit(1), so the launcher reports this
// rank with a message rather than a bare SIGABRT.
[[noreturn]] static void on_terminate() {
  const char *what = "unknown exception";
  try {
    std::exception_ptr e = std::current_exception();
    if (e) std::rethrow_exception(e);
  } catch (const std::exception &e) {
    what = e.what();
  } catch (...) {
  }
  std::fprintf(stderr,
               "dlua: gloo: the ranks disagree on the size of a transfer (%s); every rank must pass "
               "tensors of the same shape and dtype to a collective: rerun with DLUA_DIST_DEBUG=1 to "
               "find the Lua line where they differ\n",
               what);
  std::fflush(stderr);
  std::_Exit(1);
}

extern "C" dlua_pg_result_t dlua_gloo_connect(dlua_store_t *store, const char *prefix, const char *bind_host,
                                              const char *iface, int rank, int size, int64_t timeout_ms,
                                              dlua_gloo_t **out, dlua_status_t *store_status, char *err,
                                              size_t errlen) {
  *out = nullptr;
  if (store_status) *store_status = DLUA_OK;
  dlua_gloo_t *g = nullptr;
  static bool handler_set = false;
  if (!handler_set) {  // once, from the thread that creates groups
    std::set_terminate(on_terminate);
    handler_set = true;
  }
  try {
    g = new dlua_gloo_t();
    gloo::transport::tcp::attr attr;
    if (iface && *iface)
      attr.iface = iface;
    else
      attr.hostname = bind_host && *bind_host ? bind_host : "127.0.0.1";
    {
      // gloo's event-loop thread, started here, inherits SCHED_BATCH (see BatchPolicy).
      BatchPolicy batch;
      g->device = gloo::transport::tcp::CreateDevice(attr);
    }
    g->context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    g->context->setTimeout(ms(timeout_ms));
    DluaStore st(store, prefix, timeout_ms);
    g->context->connectFullMesh(st, g->device);
    *out = g;
    return DLUA_PG_OK;
  } catch (const StoreError &e) {
    if (store_status) *store_status = e.status;
    delete g;
    return fail(err, errlen, e.status == DLUA_ERR_TIMEOUT ? DLUA_PG_TIMEOUT : DLUA_PG_FAILED, e.what());
  } catch (const gloo::IoException &e) {
    delete g;
    return fail(err, errlen, strstr(e.what(), "Timed out") ? DLUA_PG_TIMEOUT : DLUA_PG_PEER_LOST, e.what());
  } catch (const std::exception &e) {
    delete g;
    return fail(err, errlen, DLUA_PG_FAILED, e.what());
  } catch (...) {
    delete g;
    return fail(err, errlen, DLUA_PG_FAILED, "unknown C++ exception");
  }
}

extern "C" void dlua_gloo_destroy(dlua_gloo_t *g) {
  if (!g) return;
  try {
    g->context.reset();  // closes the pairs
    g->device.reset();   // stops the device's event loop thread
  } catch (...) {
  }
  delete g;
}

template <size_t N>
static void allreduce_n(dlua_gloo_t *g, void *buf, size_t count, dlua_pg_reduce_fn fn, uint32_t tag,
                        int64_t timeout_ms) {
  gloo::AllreduceOptions opts(g->context);
  opts.setOutput<Elem<N>>((Elem<N> *)buf, count);
  opts.setReduceFunction([fn](void *o, const void *a, const void *b, size_t n) { fn(o, a, b, n); });
  opts.setTag(tag);
  opts.setTimeout(ms(timeout_ms));
  gloo::allreduce(opts);
}

extern "C" dlua_pg_result_t dlua_gloo_allreduce(dlua_gloo_t *g, void *buf, size_t count, size_t elsize,
                                                dlua_pg_reduce_fn fn, uint32_t tag, int64_t timeout_ms, char *err,
                                                size_t errlen) {
  return guarded(err, errlen, [&] {
    switch (elsize) {
      case 1: allreduce_n<1>(g, buf, count, fn, tag, timeout_ms); break;
      case 2: allreduce_n<2>(g, buf, count, fn, tag, timeout_ms); break;
      case 4: allreduce_n<4>(g, buf, count, fn, tag, timeout_ms); break;
      case 8: allreduce_n<8>(g, buf, count, fn, tag, timeout_ms); break;
      default: throw std::runtime_error("allreduce: unsupported element size");
    }
  });
}

extern "C" dlua_pg_result_t dlua_gloo_broadcast(dlua_gloo_t *g, void *buf, size_t count, size_t elsize, int root,
                                                uint32_t tag, int64_t timeout_ms, char *err, size_t errlen) {
  return guarded(err, errlen, [&] {
    gloo::BroadcastOptions opts(g->context);
    opts.setOutput<char>((char *)buf, count * elsize);  // bytes: broadcast never looks at elements
    opts.setRoot(root);
    opts.setTag(tag);
    opts.setTimeout(ms(timeout_ms));
    gloo::broadcast(opts);
  });
}

extern "C" dlua_pg_result_t dlua_gloo_allgatherv(dlua_gloo_t *g, const void *in, void *out, const size_t *counts,
                                                 size_t elsize, uint32_t tag, int64_t timeout_ms, char *err,
                                                 size_t errlen) {
  return guarded(err, errlen, [&] {
    int size = g->context->size, rank = g->context->rank;
    std::vector<size_t> bytes(size);
    for (int r = 0; r < size; r++) bytes[r] = counts[r] * elsize;
    gloo::AllgathervOptions opts(g->context);
    size_t before = 0;
    for (int r = 0; r < rank; r++) before += bytes[r];
    // In place (the input already sits at this rank's part) needs no input buffer.
    if ((const char *)in != (const char *)out + before) opts.setInput<char>((char *)in, bytes[rank]);
    opts.setOutput<char>((char *)out, bytes);
    opts.setTag(tag);
    opts.setTimeout(ms(timeout_ms));
    gloo::allgatherv(opts);
  });
}

extern "C" dlua_pg_result_t dlua_gloo_alltoallv(dlua_gloo_t *g, const void *in, const int64_t *in_counts, void *out,
                                                const int64_t *out_counts, size_t elsize, uint32_t tag,
                                                int64_t timeout_ms, char *err, size_t errlen) {
  return guarded(err, errlen, [&] {
    int size = g->context->size;
    std::vector<int64_t> ib(size), ob(size);
    for (int r = 0; r < size; r++) {
      ib[r] = in_counts[r] * (int64_t)elsize;
      ob[r] = out_counts[r] * (int64_t)elsize;
    }
    gloo::AlltoallvOptions opts(g->context);
    opts.setInput<char>((char *)in, ib);
    opts.setOutput<char>((char *)out, ob);
    opts.setTag(tag);
    opts.setTimeout(ms(timeout_ms));
    gloo::alltoallv(opts);
  });
}

extern "C" dlua_pg_result_t dlua_gloo_barrier(dlua_gloo_t *g, uint32_t tag, int64_t timeout_ms, char *err,
                                              size_t errlen) {
  return guarded(err, errlen, [&] {
    gloo::BarrierOptions opts(g->context);
    opts.setTag(tag);
    opts.setTimeout(ms(timeout_ms));
    gloo::barrier(opts);
  });
}

extern "C" dlua_pg_result_t dlua_gloo_exchange(dlua_gloo_t *g, const void *sbuf, size_t sbytes, int dst, void *rbuf,
                                               size_t rbytes, int src, uint8_t prefix, uint32_t tag,
                                               int64_t timeout_ms, char *err, size_t errlen) {
  return guarded(err, errlen, [&] {
    uint64_t slot = gloo::Slot::build(prefix, tag);
    std::unique_ptr<gloo::transport::UnboundBuffer> sb, rb;
    if (dst >= 0) {
      sb = g->context->createUnboundBuffer(const_cast<void *>(sbuf), sbytes);
      sb->send(dst, slot);
    }
    if (src >= 0) {
      rb = g->context->createUnboundBuffer(rbuf, rbytes);
      rb->recv(src, slot);
    }
    // Both waits share one deadline, so the call as a whole stays within timeout_ms.
    auto deadline = std::chrono::steady_clock::now() + ms(timeout_ms);
    auto left = [&] {
      auto d = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      return d.count() > 0 ? d : std::chrono::milliseconds(1);
    };
    if (rb && !rb->waitRecv(left())) throw std::runtime_error("recv aborted");
    if (sb && !sb->waitSend(left())) throw std::runtime_error("send aborted");
  });
}

// A posted point-to-point transfer: send/recv return at once; the wait happens elsewhere, so a
// rank can have several in flight and match them with its peers in any order.
struct dlua_gloo_p2p {
  std::unique_ptr<gloo::transport::UnboundBuffer> buf;
  bool send;
};

extern "C" dlua_pg_result_t dlua_gloo_p2p_post(dlua_gloo_t *g, void *ptr, size_t bytes, int peer, int is_send,
                                               uint8_t prefix, uint32_t tag, dlua_gloo_p2p_t **out, char *err,
                                               size_t errlen) {
  *out = nullptr;
  dlua_gloo_p2p_t *p = nullptr;
  dlua_pg_result_t r = guarded(err, errlen, [&] {
    p = new dlua_gloo_p2p_t();
    p->send = is_send != 0;
    p->buf = g->context->createUnboundBuffer(ptr, bytes);
    uint64_t slot = gloo::Slot::build(prefix, tag);
    if (p->send)
      p->buf->send(peer, slot);
    else
      p->buf->recv(peer, slot);
  });
  if (r != DLUA_PG_OK) {
    delete p;
    return r;
  }
  *out = p;
  return r;
}

extern "C" dlua_pg_result_t dlua_gloo_p2p_wait(dlua_gloo_p2p_t *p, int64_t timeout_ms, char *err, size_t errlen) {
  return guarded(err, errlen, [&] {
    bool ok = p->send ? p->buf->waitSend(ms(timeout_ms)) : p->buf->waitRecv(ms(timeout_ms));
    if (!ok) throw std::runtime_error(p->send ? "send aborted" : "recv aborted");
  });
}

extern "C" void dlua_gloo_p2p_free(dlua_gloo_p2p_t *p) {
  try {
    delete p;
  } catch (...) {
  }
}
