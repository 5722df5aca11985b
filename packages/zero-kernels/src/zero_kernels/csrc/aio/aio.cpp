// Async file I/O for offload, O_DIRECT where the filesystem takes it. Two engines behind one interface:
// - kernel AIO (default): thread_count submitter threads, each keeping queue_depth block_size requests in flight
//   with io_submit/io_getevents on its own context, as DeepSpeed's libaio op and fio's libaio engine do. The raw
//   syscalls and <linux/aio_abi.h> (from linux-libc-dev, installed with any C compiler) are used: no libaio needed.
// - a thread pool: queue_depth x thread_count threads issuing synchronous pread/pwrite; used where io_setup is
//   refused (seccomp, aio-max-nr exhausted) or when asked for.
// Only pybind11 is included: Python passes raw, aligned buffer addresses.
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#define ZERO_STR_(x) #x
#define ZERO_STR(x) ZERO_STR_(x)
#ifdef ZERO_OP_SOURCE_HASH
#define ZERO_SOURCE_HASH ZERO_STR(ZERO_OP_SOURCE_HASH)
#else
#define ZERO_SOURCE_HASH "unknown"
#endif

namespace py = pybind11;

namespace {

constexpr int64_t kAlign = 4096;

// One submitted read or write of a whole buffer; split into chunks that workers run.
struct Request {
  bool write = false;
  std::string path;
  int fd_direct = -1;    // O_DIRECT descriptor, or -1
  int fd_buffered = -1;  // always open: unaligned chunks and the O_DIRECT fallback
  char* buf = nullptr;
  int64_t nbytes = 0;
  int64_t offset = 0;
  std::atomic<int64_t> chunks_left{0};
  std::mutex mu;
  std::string error;  // first failure, empty if none
  bool done = false;
  std::condition_variable cv;
};

struct Chunk {
  std::shared_ptr<Request> req;
  int64_t start;  // byte offset inside the request
  int64_t len;
};

bool aligned(const void* p, int64_t off, int64_t len) {
  return reinterpret_cast<uintptr_t>(p) % kAlign == 0 && off % kAlign == 0 && len % kAlign == 0;
}

class Engine {
 public:
  // kernel_aio: use io_submit/io_getevents (thread_count contexts of queue_depth requests); falls back to the
  // thread pool, with the reason in fallback_reason(), if io_setup is refused.
  Engine(int64_t block_size, int queue_depth, int thread_count, bool use_direct, bool kernel_aio, bool single_submit,
         bool overlap_events)
      : block_size_(block_size),
        use_direct_(use_direct),
        depth_(queue_depth),
        single_submit_(single_submit),
        overlap_events_(overlap_events) {
    if (block_size < kAlign || block_size % kAlign)
      throw std::invalid_argument("aio.block_size must be a positive multiple of 4096 bytes, got " +
                                  std::to_string(block_size));
    if (queue_depth < 1) throw std::invalid_argument("aio.queue_depth must be >= 1, got " + std::to_string(queue_depth));
    if (thread_count < 1)
      throw std::invalid_argument("aio.thread_count must be >= 1, got " + std::to_string(thread_count));
    if (kernel_aio) {
      for (int i = 0; i < thread_count; ++i) {
        aio_context_t ctx = 0;
        if (::syscall(SYS_io_setup, queue_depth, &ctx) != 0) {
          fallback_ = std::string("io_setup failed: ") + std::strerror(errno);
          for (auto c : ctxs_) ::syscall(SYS_io_destroy, c);
          ctxs_.clear();
          break;
        }
        ctxs_.push_back(ctx);
      }
    }
    if (!ctxs_.empty()) {
      for (auto ctx : ctxs_) threads_.emplace_back([this, ctx] { run_kernel_aio(ctx); });
    } else {
      int workers = queue_depth * thread_count;
      for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { run(); });
    }
  }

  ~Engine() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    for (auto ctx : ctxs_) ::syscall(SYS_io_destroy, ctx);
    for (auto& kv : reqs_) close_fds(*kv.second);
  }

  // Returns a request id; the file is created (writes) or must exist (reads).
  int64_t submit(bool write, const std::string& path, uintptr_t buf, int64_t nbytes, int64_t offset) {
    if (nbytes < 0 || offset < 0) throw std::invalid_argument("aio: negative size or offset for " + path);
    auto req = std::make_shared<Request>();
    req->write = write;
    req->path = path;
    req->buf = reinterpret_cast<char*>(buf);
    req->nbytes = nbytes;
    req->offset = offset;
    int flags = write ? (O_WRONLY | O_CREAT) : O_RDONLY;
    req->fd_buffered = ::open(path.c_str(), flags, 0644);
    if (req->fd_buffered < 0) throw_errno(write ? "open for write" : "open for read", *req, 0, nbytes, errno);
    if (write && nbytes > 0) {
      // Reserve the blocks up front (as fio does): concurrent O_DIRECT writes that extend a file serialise on the
      // inode in ext4/xfs, writes inside allocated space do not. A filesystem without fallocate just skips this.
      struct stat st;
      if (::fstat(req->fd_buffered, &st) == 0 && st.st_size < offset + nbytes) {
        int rc = ::posix_fallocate(req->fd_buffered, 0, offset + nbytes);
        if (rc == ENOSPC) {
          ::close(req->fd_buffered);
          throw_errno("reserving space for a write", *req, 0, nbytes, rc);
        }
      }
    }
    if (use_direct_) {
      req->fd_direct = ::open(path.c_str(), flags | O_DIRECT, 0644);
      if (req->fd_direct < 0) direct_fallbacks_++;  // tmpfs and some FUSE filesystems refuse O_DIRECT
    }
    std::vector<Chunk> chunks;
    for (int64_t s = 0; s < nbytes; s += block_size_) chunks.push_back({req, s, std::min(block_size_, nbytes - s)});
    req->chunks_left = static_cast<int64_t>(chunks.size());
    int64_t id;
    {
      std::lock_guard<std::mutex> g(mu_);
      id = next_id_++;
      reqs_[id] = req;
      if (chunks.empty()) req->done = true;
      for (auto& c : chunks) queue_.push_back(std::move(c));
    }
    cv_.notify_all();
    return id;
  }

  // Blocks until request id finishes; raises RuntimeError with path/offset/size on failure. Releases the GIL.
  void wait(int64_t id) {
    std::shared_ptr<Request> req;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = reqs_.find(id);
      if (it == reqs_.end()) throw std::invalid_argument("aio.wait: unknown or already waited request " + std::to_string(id));
      req = it->second;
      reqs_.erase(it);
    }
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lk(req->mu);
      req->cv.wait(lk, [&] { return req->done; });
    }
    close_fds(*req);
    if (!req->error.empty()) throw std::runtime_error(req->error);
  }

  // Test hook: the next `count` chunks of reads (write=false) or writes fail with errno `err`.
  void inject_error(bool write, int err, int count) {
    std::lock_guard<std::mutex> g(mu_);
    (write ? fault_write_ : fault_read_) = {err, count};
  }

  // Test hook: the next `count` chunks of reads or writes sleep `seconds` before their I/O (a slow disk).
  void inject_delay(bool write, double seconds, int count) {
    std::lock_guard<std::mutex> g(mu_);
    (write ? delay_write_ : delay_read_) = {seconds, count};
  }

  int64_t direct_fallbacks() const { return direct_fallbacks_.load(); }
  int workers() const { return static_cast<int>(threads_.size()); }
  std::string kind() const { return ctxs_.empty() ? "threads" : "kernel_aio"; }
  std::string fallback_reason() const { return fallback_; }

 private:
  static void close_fds(Request& r) {
    if (r.fd_direct >= 0) ::close(r.fd_direct);
    if (r.fd_buffered >= 0) ::close(r.fd_buffered);
    r.fd_direct = r.fd_buffered = -1;
  }

  [[noreturn]] static void throw_errno(const char* what, const Request& r, int64_t start, int64_t len, int err) {
    throw std::runtime_error(std::string("aio: ") + what + " of '" + r.path + "' at offset " +
                             std::to_string(r.offset + start) + ", " + std::to_string(len) +
                             " bytes failed: " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
  }

  static std::string describe(const Request& r, int64_t start, int64_t len, const std::string& why) {
    return std::string("aio: ") + (r.write ? "write" : "read") + " of '" + r.path + "' at offset " +
           std::to_string(r.offset + start) + ", " + std::to_string(len) + " bytes failed: " + why;
  }

  static std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

  // The test hooks, applied before a chunk's I/O: an injected error message, or "" (after any injected delay).
  std::string inject(const Chunk& c) {
    Request& r = *c.req;
    double delay = 0;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto& f = r.write ? fault_write_ : fault_read_;
      if (f.second > 0) {
        f.second--;
        int err = f.first;
        return describe(r, c.start, c.len,
                        std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ", injected)");
      }
      auto& d = r.write ? delay_write_ : delay_read_;
      if (d.second > 0) {
        d.second--;
        delay = d.first;
      }
    }
    if (delay > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay));
    return "";
  }

  // O_DIRECT descriptor when the transfer [done, len) of the chunk is aligned, else the buffered one.
  static int pick_fd(const Chunk& c, int64_t done) {
    const Request& r = *c.req;
    bool ok = r.fd_direct >= 0 && aligned(r.buf + c.start + done, r.offset + c.start + done, c.len - done);
    return ok ? r.fd_direct : r.fd_buffered;
  }

  // Synchronous pread/pwrite of bytes [done, len) of the chunk; returns an error message or "".
  static std::string sync_io(const Chunk& c, int64_t done) {
    Request& r = *c.req;
    char* p = r.buf + c.start;
    int64_t off = r.offset + c.start;
    int fd = pick_fd(c, done);
    while (done < c.len) {
      ssize_t n = r.write ? ::pwrite(fd, p + done, c.len - done, off + done) : ::pread(fd, p + done, c.len - done, off + done);
      if (n < 0) {
        if (errno == EINTR) continue;
        return describe(r, c.start, c.len, errno_text(errno));
      }
      if (n == 0) {
        return describe(r, c.start, c.len, r.write ? "the device accepted 0 bytes (no space?)"
                                                   : "short read: end of file after " + std::to_string(done) + " bytes");
      }
      done += n;
      if (done < c.len) fd = pick_fd(c, done);  // a partial direct transfer may leave an unaligned rest
    }
    return "";
  }

  static bool failed(const Chunk& c) {
    std::lock_guard<std::mutex> g(c.req->mu);
    return !c.req->error.empty();
  }

  // Records a chunk's outcome ("" = success, "skip" = not run because its request already failed).
  static void finish(const Chunk& c, const std::string& err) {
    std::lock_guard<std::mutex> g(c.req->mu);
    if (!err.empty() && err != "skip" && c.req->error.empty()) c.req->error = err;
    if (--c.req->chunks_left == 0) {
      c.req->done = true;
      c.req->cv.notify_all();
    }
  }

  // Thread-pool worker: one chunk at a time, synchronously.
  void run() {
    for (;;) {
      Chunk c;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty()) return;
        c = std::move(queue_.front());
        queue_.pop_front();
      }
      if (failed(c)) {  // an earlier chunk failed: do not keep writing
        finish(c, "skip");
        continue;
      }
      std::string err = inject(c);
      finish(c, err.empty() ? sync_io(c, 0) : err);
    }
  }

  // Kernel-AIO submitter: keeps up to depth_ chunks in flight on `ctx`, refilling as completions arrive
  // (overlap_events) or after the whole batch completed (not overlap_events); single_submit = one iocb per call.
  void run_kernel_aio(aio_context_t ctx) {
    std::vector<Chunk> slots(depth_);
    std::vector<struct iocb> cbs(depth_);
    std::vector<struct iocb*> ptrs;
    std::vector<struct io_event> events(depth_);
    std::vector<int> free_slots;
    for (int i = depth_ - 1; i >= 0; --i) free_slots.push_back(i);
    int inflight = 0;
    for (;;) {
      std::vector<Chunk> batch;
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (inflight == 0) {
          cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
          if (stop_ && queue_.empty()) return;
        }
        if (overlap_events_ || inflight == 0) {
          while (inflight + static_cast<int>(batch.size()) < depth_ && !queue_.empty()) {
            batch.push_back(std::move(queue_.front()));
            queue_.pop_front();
          }
        }
      }
      ptrs.clear();
      for (auto& c : batch) {
        if (failed(c)) {
          finish(c, "skip");
          continue;
        }
        std::string err = inject(c);
        if (!err.empty()) {
          finish(c, err);
          continue;
        }
        int slot = free_slots.back();
        free_slots.pop_back();
        struct iocb& cb = cbs[slot];
        std::memset(&cb, 0, sizeof(cb));
        cb.aio_data = static_cast<uint64_t>(slot);
        cb.aio_lio_opcode = c.req->write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
        cb.aio_fildes = static_cast<uint32_t>(pick_fd(c, 0));
        cb.aio_buf = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(c.req->buf + c.start));
        cb.aio_nbytes = static_cast<uint64_t>(c.len);
        cb.aio_offset = c.req->offset + c.start;
        slots[slot] = std::move(c);
        ptrs.push_back(&cb);
      }
      size_t pos = 0;
      while (pos < ptrs.size()) {
        long n = single_submit_ ? 1 : static_cast<long>(ptrs.size() - pos);
        long rc = ::syscall(SYS_io_submit, ctx, n, ptrs.data() + pos);
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0) {  // the kernel refused this iocb (EAGAIN, EINVAL for this fd): run it synchronously instead
          int slot = static_cast<int>(ptrs[pos]->aio_data);
          Chunk c = std::move(slots[slot]);
          free_slots.push_back(slot);
          finish(c, sync_io(c, 0));
          ++pos;
          continue;
        }
        pos += static_cast<size_t>(rc);
        inflight += static_cast<int>(rc);
      }
      if (inflight == 0) continue;
      long got = ::syscall(SYS_io_getevents, ctx, overlap_events_ ? 1L : static_cast<long>(inflight),
                           static_cast<long>(depth_), events.data(), nullptr);
      if (got < 0) {
        if (errno == EINTR) continue;
        // The context is unusable: fail what it holds rather than leave waiters blocked forever.
        std::string why = "io_getevents: " + errno_text(errno);
        for (int s = 0; s < depth_; ++s) {
          if (slots[s].req) {
            finish(slots[s], describe(*slots[s].req, slots[s].start, slots[s].len, why));
            slots[s] = Chunk{};
          }
        }
        return;
      }
      for (long i = 0; i < got; ++i) {
        int slot = static_cast<int>(events[i].data);
        Chunk c = std::move(slots[slot]);
        slots[slot] = Chunk{};
        free_slots.push_back(slot);
        --inflight;
        int64_t res = events[i].res;
        std::string err;
        if (res < 0) {
          err = describe(*c.req, c.start, c.len, errno_text(static_cast<int>(-res)));
        } else if (res < c.len) {
          err = sync_io(c, res);  // a short transfer: finish it synchronously (end of file gives the short read)
        }
        finish(c, err);
      }
    }
  }

  int64_t block_size_;
  bool use_direct_;
  int depth_;
  bool single_submit_, overlap_events_;
  std::vector<aio_context_t> ctxs_;
  std::string fallback_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Chunk> queue_;
  std::map<int64_t, std::shared_ptr<Request>> reqs_;
  int64_t next_id_ = 1;
  bool stop_ = false;
  std::pair<int, int> fault_read_{0, 0}, fault_write_{0, 0};
  std::pair<double, int> delay_read_{0, 0}, delay_write_{0, 0};
  std::atomic<int64_t> direct_fallbacks_{0};
};

// 1 if `dir` accepts O_DIRECT (probed with a temporary file that is removed), 0 if not.
bool probe_direct(const std::string& dir) {
  std::string path = dir + "/.zero_odirect_probe_" + std::to_string(::getpid());
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0600);
  if (fd < 0) {
    int fd2 = ::open(path.c_str(), O_WRONLY | O_CREAT, 0600);
    if (fd2 >= 0) {
      ::close(fd2);
      ::unlink(path.c_str());
    }
    return false;
  }
  void* buf = nullptr;
  bool ok = posix_memalign(&buf, kAlign, kAlign) == 0;
  if (ok) {
    std::memset(buf, 0, kAlign);
    ok = ::pwrite(fd, buf, kAlign, 0) == kAlign;
    free(buf);
  }
  ::close(fd);
  ::unlink(path.c_str());
  return ok;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zero_kernels async I/O: kernel AIO or a thread pool of pread/pwrite (O_DIRECT where supported) on raw buffers.";
  m.attr("source_hash") = ZERO_SOURCE_HASH;
  m.attr("alignment") = kAlign;
  py::class_<Engine>(m, "Engine")
      .def(py::init<int64_t, int, int, bool, bool, bool, bool>(), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("thread_count"), py::arg("use_direct"), py::arg("kernel_aio") = true, py::arg("single_submit") = false,
           py::arg("overlap_events") = true)
      .def("submit", &Engine::submit, py::arg("write"), py::arg("path"), py::arg("buf"), py::arg("nbytes"),
           py::arg("offset"))
      .def("wait", &Engine::wait, py::arg("id"))
      .def("inject_error", &Engine::inject_error, py::arg("write"), py::arg("err"), py::arg("count"))
      .def("inject_delay", &Engine::inject_delay, py::arg("write"), py::arg("seconds"), py::arg("count"))
      .def("direct_fallbacks", &Engine::direct_fallbacks)
      .def("workers", &Engine::workers)
      .def("kind", &Engine::kind)
      .def("fallback_reason", &Engine::fallback_reason);
  m.def("probe_direct", &probe_direct, py::arg("dir"), "True if files in dir can be opened and written O_DIRECT.");
}
