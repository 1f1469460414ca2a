// Large CPU buffers, each its own anonymous mapping, freed ones kept by size for reuse.
//
// glibc serves a training step's activation-sized buffers either from fresh mappings (unmapped on
// free: every step faults the same pages in again, each zero-filled) or, with the mmap threshold
// raised (lorafuse.heap), from its heap, where buffers freed between longer-lived ones leave holes
// that the next step fills in another order: a Llama-3.2-1B NF4 step at 1 x 512 ended with 491 MiB
// of the heap free but resident, and peaked ~150 MiB above what a fresh mapping per buffer needs.
//
// This allocator takes every torch CPU allocation of at least `min_bytes` (smaller ones go to the
// allocator it replaced): a freed block joins a cache, and an allocation of the same rounded size
// takes the most recently freed one (no system call, no page fault). On a miss the oldest cached
// blocks are unmapped first, at least as many bytes as the new block maps, so the bytes mapped
// here grow only while the cache is empty: they never exceed the most bytes ever alive at once
// (plus what a trim has not yet returned). A step that allocates the same sizes every time runs
// from the cache; its peak is what it holds at once.
//
// POSIX only (mmap): on Windows the entry points exist and say it is unavailable, so this one file
// never keeps the other kernels from building there. MADV_HUGEPAGE is Linux's; elsewhere the
// blocks are aligned to 2 MiB all the same, without the hint.
#if !defined(_WIN32)
#include <sys/mman.h>
#endif

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <torch/extension.h>

#include <atomic>
#include <list>
#include <mutex>
#include <unordered_map>

namespace lorafuse {
#if defined(_WIN32)
void large_buffers_install(int64_t, bool) {
  TORCH_CHECK(false, "lorafuse large_buffers: needs mmap (Linux, macOS); not available on Windows");
}
py::dict large_buffers_stats() {
  py::dict out;
  out["installed"] = false;
  return out;
}
int64_t large_buffers_trim() { return 0; }
void large_buffers_reset_peak() {}
#else
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHugePage = 2 << 20;

struct Counters {
  size_t live = 0;       // bytes in blocks handed out and not yet freed
  size_t cached = 0;     // bytes in freed blocks kept mapped for reuse
  size_t peak_live = 0;  // the most live bytes at once since the last reset_peak
  size_t high_water = 0;  // the most bytes mapped (live + cached) at once since then
  size_t hits = 0, misses = 0, unmapped = 0;  // allocations from the cache / new mappings; evictions
};

class LargeBufferAllocator final : public c10::Allocator {
 public:
  explicit LargeBufferAllocator(c10::Allocator* fallback)
      : fallback_(fallback), fallback_deleter_(fallback->raw_deleter()) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_.load(std::memory_order_relaxed)) return fallback_->allocate(n);
    size_t unit = huge_pages_ && n >= 2 * kHugePage ? kHugePage : kPage;
    size_t size = (n + unit - 1) / unit * unit;
    void* ptr = take(size);
    return {ptr, ptr, &release_any, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release_any; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void set_min_bytes(size_t n) { min_bytes_.store(n, std::memory_order_relaxed); }
  void set_huge_pages(bool on) { huge_pages_ = on; }
  size_t min_bytes() const { return min_bytes_.load(std::memory_order_relaxed); }

  Counters counters() {
    std::lock_guard<std::mutex> lock(mutex_);
    return counters_;
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    counters_.peak_live = counters_.live;
    counters_.high_water = mapped();
  }

  size_t trim() {  // unmap every cached block; returns the bytes given back
    std::lock_guard<std::mutex> lock(mutex_);
    size_t bytes = counters_.cached;
    while (!cache_.empty()) evict_oldest();
    counters_.high_water = mapped();
    return bytes;
  }

  static LargeBufferAllocator* instance;

 private:
  struct Block {
    void* ptr;
    size_t size;
  };

  void* take(size_t size) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = cache_.begin(); it != cache_.end(); ++it) {  // most recently freed first
        if (it->size != size) continue;
        void* ptr = it->ptr;
        cache_.erase(it);
        counters_.cached -= size;
        counters_.hits++;
        return handed_out(ptr, size);
      }
      // Map no more than the high-water mark: unmap the oldest cached blocks first where needed.
      while (!cache_.empty() && mapped() + size > counters_.high_water) evict_oldest();
      counters_.misses++;
    }
    void* ptr = map(size);
    std::lock_guard<std::mutex> lock(mutex_);
    return handed_out(ptr, size);
  }

  static void* map_aligned(size_t size) {
    bool huge = size % kHugePage == 0;
    size_t extra = huge ? kHugePage : 0;
    void* raw = mmap(nullptr, size + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    if (raw == MAP_FAILED || !huge) return raw;
    uintptr_t p = reinterpret_cast<uintptr_t>(raw);
    uintptr_t aligned = (p + kHugePage - 1) / kHugePage * kHugePage;
    if (aligned > p) munmap(raw, aligned - p);
    if (p + extra > aligned) munmap(reinterpret_cast<void*>(aligned + size), p + extra - aligned);
    void* ptr = reinterpret_cast<void*>(aligned);
#if defined(MADV_HUGEPAGE)
    madvise(ptr, size, MADV_HUGEPAGE);
#endif
    return ptr;
  }

  void* map(size_t size) {
    void* ptr = map_aligned(size);
    if (ptr == MAP_FAILED) {  // give the cache back and try once more before failing
      trim();
      ptr = map_aligned(size);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, ptr != MAP_FAILED, "lorafuse large_buffers: cannot map ",
                     size, " bytes (", counters().live, " bytes alive in large buffers)");
    return ptr;
  }

  size_t mapped() const { return counters_.live + counters_.cached; }  // mutex_ held

  void* handed_out(void* ptr, size_t size) {  // mutex_ held
    live_[ptr] = size;
    counters_.live += size;
    if (counters_.live > counters_.peak_live) {
      counters_.peak_live = counters_.live;
      peak_blocks_.clear();
      for (auto& kv : live_) peak_blocks_.push_back(kv.second);
    }
    counters_.high_water = std::max(counters_.high_water, mapped());
    report(ptr, static_cast<int64_t>(size));
    return ptr;
  }

  size_t evict_oldest() {  // mutex_ held
    Block block = cache_.back();
    cache_.pop_back();
    munmap(block.ptr, block.size);
    counters_.cached -= block.size;
    counters_.unmapped++;
    return block.size;
  }

  // torch.profiler(profile_memory=True) sees these blocks as it sees the default allocator's.
  void report(void* ptr, int64_t delta) {  // mutex_ held
    if (c10::memoryProfilingEnabled()) {
      c10::reportMemoryUsageToProfiler(ptr, delta, counters_.live,
                                       counters_.live + counters_.cached,
                                       c10::Device(c10::DeviceType::CPU));
    }
  }

  // The deleter of every pointer this allocator hands out, and its raw_deleter: a large block
  // goes to the cache; anything else was the fallback's.
  static void release_any(void* ptr) {
    LargeBufferAllocator* self = instance;
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      auto it = self->live_.find(ptr);
      if (it != self->live_.end()) {
        size_t size = it->second;
        self->live_.erase(it);
        self->counters_.live -= size;
        self->counters_.cached += size;
        self->cache_.push_front({ptr, size});
        self->report(ptr, -static_cast<int64_t>(size));
        return;
      }
    }
    if (self->fallback_deleter_) {
      self->fallback_deleter_(ptr);
    } else {
      c10::free_cpu(ptr);
    }
  }

  c10::Allocator* fallback_;
  c10::DeleterFnPtr fallback_deleter_;
  std::atomic<size_t> min_bytes_{SIZE_MAX};
  std::atomic<bool> huge_pages_{false};
  std::mutex mutex_;
  std::unordered_map<void*, size_t> live_;
  std::list<Block> cache_;  // front: most recently freed
  Counters counters_;
 public:
  std::vector<size_t> peak_blocks_;
};

LargeBufferAllocator* LargeBufferAllocator::instance = nullptr;

}  // namespace

// Install the allocator as torch's CPU allocator (once; later calls only set min_bytes; 0 turns
// new allocations back to the fallback). It stays installed for the process: blocks handed out
// must find their deleter, and the allocator torch had keeps serving the small allocations.
void large_buffers_install(int64_t min_bytes, bool huge_pages) {
  static std::once_flag once;
  std::call_once(once, [] {
    LargeBufferAllocator::instance = new LargeBufferAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(LargeBufferAllocator::instance, /*priority=*/1);
  });
  TORCH_CHECK(min_bytes >= 0, "large_buffers_install: min_bytes must be >= 0, got ", min_bytes);
  LargeBufferAllocator::instance->set_huge_pages(huge_pages);
  LargeBufferAllocator::instance->set_min_bytes(min_bytes == 0 ? SIZE_MAX
                                                               : static_cast<size_t>(min_bytes));
}

py::dict large_buffers_stats() {
  py::dict out;
  LargeBufferAllocator* self = LargeBufferAllocator::instance;
  out["installed"] = self != nullptr && c10::GetCPUAllocator() == self;
  if (self == nullptr) return out;
  Counters c = self->counters();
  size_t min_bytes = self->min_bytes();
  out["min_bytes"] = min_bytes == SIZE_MAX ? 0 : min_bytes;
  out["live"] = c.live;
  out["cached"] = c.cached;
  out["peak_live"] = c.peak_live;
  out["high_water"] = c.high_water;
  out["peak_blocks"] = self->peak_blocks_;
  out["hits"] = c.hits;
  out["misses"] = c.misses;
  out["unmapped"] = c.unmapped;
  return out;
}

int64_t large_buffers_trim() {
  LargeBufferAllocator* self = LargeBufferAllocator::instance;
  return self ? static_cast<int64_t>(self->trim()) : 0;
}

void large_buffers_reset_peak() {
  if (LargeBufferAllocator::instance) LargeBufferAllocator::instance->reset_peak();
}
#endif  // !_WIN32

}  // namespace lorafuse
