// The Metal subset of kpt's shaders, as C++17, and the runtime that executes a dispatch on the CPU.
//
// A shader is compiled as written against this header (it replaces <metal_stdlib>); the Python
// side (kpt_mps.emulator) only rewrites threadgroup array declarations into tracked arrays and
// appends one launcher per kernel. What the header does not declare is outside the subset and
// fails the build. Semantics kept from Metal:
//   * every thread of a threadgroup (up to 1024) is a fiber; threadgroup_barrier suspends it until
//     every thread of its group arrives (a thread that returns while others wait is an error);
//   * simdgroups of 32 lanes: simd_sum/max/min/prefix sums/shuffles/broadcast and simdgroup_barrier
//     are collective: every lane of the simdgroup must call the same function (else an error);
//   * threadgroup memory is shared by the threads of one group and checked like compute-sanitizer's
//     racecheck: an element written by one thread and read or written by another with no barrier
//     between them is reported, as is a read before any write and an index out of bounds.
#pragma once

#include <csetjmp>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <sys/mman.h>
#include <ucontext.h>
#include <vector>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

namespace mtl {

// ---- 16-bit floats: storage types converted to and from float with round-to-nearest-even ------
inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

struct half {
  uint16_t bits = 0;
  half() = default;
  half(float f) { bits = from_float(f); }
  operator float() const { return to_float(bits); }
  static uint16_t from_float(float f) {
    uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);            // NaN
    if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);           // rounds to infinity
    if (a < 0x38800000u) {                                           // subnormal half (or zero)
      float v = bits_f32(a) * 16777216.0f;                           // exact: a / 2^-24
      return uint16_t(sign | uint32_t(std::nearbyint(v)));
    }
    uint32_t mant = a & 0x7fffffu, exp = (a >> 23) - 112;
    uint32_t h = (exp << 10) | (mant >> 13), rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;
    return uint16_t(sign | h);
  }
  static float to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) return bits_f32(sign) + (sign ? -1.0f : 1.0f) * float(mant) * 5.9604644775390625e-8f;
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
    return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
  }
};

template <class To, class From> inline To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To t; std::memcpy(&t, &v, sizeof(To)); return t;
}

namespace emu {

enum State : int { RUNNABLE, WAIT_BARRIER, WAIT_SIMD, DONE, ABORTED };
struct Fiber;
typedef void (*Collective)(Fiber** lanes, int n);

// the built-in arguments, in the order of kpt_mps.emulator.BUILTINS (the launchers index them)
struct Builtins {
  uint v[10];
};
typedef void (*Launch)(void* const* buffers, const Builtins& b);

struct Fiber {
  jmp_buf jb;
  ucontext_t uc;
  char* stack = nullptr;
  int state = DONE;
  uint lid = 0;             // thread index in its group
  Collective op = nullptr;  // the collective this lane waits at
  const void* in = nullptr;
  void* out = nullptr;
  int arg = 0;
};

constexpr int SIMD = 32;
constexpr size_t STACK = 256 * 1024;

struct Run {
  Launch launch = nullptr;
  void* const* buffers = nullptr;
  uint groups = 0, group_size = 0, group = 0;
  uint32_t tg_epoch = 0;
  uint32_t sg_epoch[1024 / SIMD] = {};
  unsigned long serial = 0;  // one per threadgroup executed: resets threadgroup memory
  std::string error;
  std::vector<struct Region*> regions;  // the threadgroup arrays this group touched
};

inline Run& run() { static Run r; return r; }
inline std::vector<Fiber>& fibers() { static std::vector<Fiber> f(1024); return f; }
inline Fiber*& current() { static Fiber* c = nullptr; return c; }
inline jmp_buf& sched() { static jmp_buf j; return j; }
inline ucontext_t& init_ctx() { static ucontext_t u; return u; }
inline bool& fibers_valid() { static bool v = false; return v; }

inline void block(int state) {
  Fiber* f = current();
  f->state = state;
  if (!_setjmp(f->jb)) _longjmp(sched(), 1);
}

inline void fail(const std::string& message) {
  Run& r = run();
  if (r.error.empty()) r.error = message + " (threadgroup " + std::to_string(r.group) + ")";
  block(ABORTED);
}

inline void run_thread(Fiber* f) {
  Run& r = run();
  Builtins b = {{r.group * r.group_size + f->lid, f->lid, r.group, r.group_size, r.groups, f->lid % SIMD,
                  f->lid / SIMD, (r.group_size + SIMD - 1) / SIMD, uint(SIMD), r.groups * r.group_size}};
  r.launch(r.buffers, b);
}

inline void trampoline() {
  if (!_setjmp(current()->jb)) swapcontext(&current()->uc, &init_ctx());
  for (;;) {
    run_thread(current());
    block(DONE);
  }
}

inline void init_fibers(uint n) {
  std::vector<Fiber>& fs = fibers();
  for (uint i = 0; i < n; ++i) {
    Fiber& f = fs[i];
    if (!f.stack) {
      void* p = mmap(nullptr, STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      f.stack = static_cast<char*>(p);
      mprotect(f.stack, 4096, PROT_NONE);  // a guard page: a stack overflow faults, never corrupts
    }
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack;
    f.uc.uc_stack.ss_size = STACK;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, trampoline, 0);
    current() = &f;
    swapcontext(&init_ctx(), &f.uc);
  }
}

inline void resume(Fiber* f) {
  current() = f;
  if (!_setjmp(sched())) _longjmp(f->jb, 1);
}

inline const char* state_name(int s) {
  return s == WAIT_BARRIER ? "waits at threadgroup_barrier" : s == WAIT_SIMD ? "waits at a simdgroup function"
                                                            : "has returned";
}

// ---- collectives ----------------------------------------------------------------------------
inline void collective(Collective op, const void* in, void* out, int arg = 0) {
  Fiber* f = current();
  f->op = op; f->in = in; f->out = out; f->arg = arg;
  block(WAIT_SIMD);
}

template <class T> struct Ops {
  static T at(Fiber** l, int i) { return *static_cast<const T*>(l[i]->in); }
  static void put(Fiber** l, int i, T v) { *static_cast<T*>(l[i]->out) = v; }
  static void sum(Fiber** l, int n) { T a = at(l, 0); for (int i = 1; i < n; ++i) a = a + at(l, i); for (int i = 0; i < n; ++i) put(l, i, a); }
  static void max(Fiber** l, int n) { T a = at(l, 0); for (int i = 1; i < n; ++i) { T v = at(l, i); a = (v > a || a != a) ? v : a; } for (int i = 0; i < n; ++i) put(l, i, a); }
  static void min(Fiber** l, int n) { T a = at(l, 0); for (int i = 1; i < n; ++i) { T v = at(l, i); a = (v < a || a != a) ? v : a; } for (int i = 0; i < n; ++i) put(l, i, a); }
  static void prefix_exclusive_sum(Fiber** l, int n) { T a = T(0); for (int i = 0; i < n; ++i) { T v = at(l, i); put(l, i, a); a = a + v; } }
  static void prefix_inclusive_sum(Fiber** l, int n) { T a = T(0); for (int i = 0; i < n; ++i) { a = a + at(l, i); put(l, i, a); } }
  static T lane(Fiber** l, int n, int i, int src) { return (src >= 0 && src < n) ? at(l, src) : at(l, i); }
  static void shuffle(Fiber** l, int n) { T v[SIMD]; for (int i = 0; i < n; ++i) v[i] = lane(l, n, i, l[i]->arg); for (int i = 0; i < n; ++i) put(l, i, v[i]); }
  static void shuffle_xor(Fiber** l, int n) { T v[SIMD]; for (int i = 0; i < n; ++i) v[i] = lane(l, n, i, i ^ l[i]->arg); for (int i = 0; i < n; ++i) put(l, i, v[i]); }
  static void shuffle_down(Fiber** l, int n) { T v[SIMD]; for (int i = 0; i < n; ++i) v[i] = lane(l, n, i, i + l[i]->arg); for (int i = 0; i < n; ++i) put(l, i, v[i]); }
  static void shuffle_up(Fiber** l, int n) { T v[SIMD]; for (int i = 0; i < n; ++i) v[i] = lane(l, n, i, i - l[i]->arg); for (int i = 0; i < n; ++i) put(l, i, v[i]); }
};

inline void sg_barrier_op(Fiber** l, int) { run().sg_epoch[l[0]->lid / SIMD] += 1; }

// ---- threadgroup memory with the race check -------------------------------------------------
struct Meta {
  int writer = -1;            // -1: never written
  uint32_t w_tg = 0, w_sg = 0;
  int reader = -1;            // -1: none since the write; -2: several threads
  uint32_t r_tg = 0, r_sg = 0;
  int r_simd = -1;            // the simdgroup of the reader(s), -1 if several
  int early = -1;             // a thread that read it before any write (judged when the group ends)
};

inline bool ordered(int thread, uint32_t tg, uint32_t sg, int simd, int me) {
  Run& r = run();
  if (thread == me) return true;
  if (tg != r.tg_epoch) return true;
  int mine = me / SIMD;
  return simd == mine && sg != r.sg_epoch[mine];
}

struct Region {
  const char* name = "";
  int size = 0;
  Meta* meta = nullptr;
  unsigned long serial = 0;

  void check(int i) const {
    if (i < 0 || i >= size)
      fail(std::string("threadgroup memory ") + name + "[" + std::to_string(i) + "] is out of bounds (" +
           std::to_string(size) + " elements), thread " + std::to_string(current()->lid));
  }
  std::string where(int i) const { return std::string(name) + "[" + std::to_string(i) + "]"; }

  void read(int i) {
    check(i);
    Meta& m = meta[i];
    Run& r = run();
    int me = int(current()->lid), simd = me / SIMD;
    if (m.writer == -1 && m.early == -1) m.early = me;
    if (m.writer >= 0 && !ordered(m.writer, m.w_tg, m.w_sg, m.writer / SIMD, me))
      fail("threadgroup memory race on " + where(i) + ": thread " + std::to_string(m.writer) + " wrote it and thread " +
           std::to_string(me) + " read it with no barrier between");
    if (m.reader == -1 || (m.reader >= 0 && ordered(m.reader, m.r_tg, m.r_sg, m.r_simd, me))) {
      m.reader = me; m.r_tg = r.tg_epoch; m.r_sg = r.sg_epoch[simd]; m.r_simd = simd;
    } else if (m.reader != me) {
      if (m.reader == -2 && !(m.r_tg == r.tg_epoch)) { m.r_tg = r.tg_epoch; m.r_sg = r.sg_epoch[simd]; m.r_simd = simd; }
      m.reader = -2;
      if (m.r_simd != simd) m.r_simd = -1;
    }
  }

  void write(int i) {
    check(i);
    Meta& m = meta[i];
    Run& r = run();
    int me = int(current()->lid), simd = me / SIMD;
    if (m.writer >= 0 && !ordered(m.writer, m.w_tg, m.w_sg, m.writer / SIMD, me))
      fail("threadgroup memory race on " + where(i) + ": threads " + std::to_string(m.writer) + " and " +
           std::to_string(me) + " both wrote it with no barrier between");
    bool reads_ordered = m.reader == -1 ||
        (m.reader == -2 ? (m.r_tg != r.tg_epoch || (m.r_simd == simd && m.r_sg != r.sg_epoch[simd]))
                        : ordered(m.reader, m.r_tg, m.r_sg, m.r_simd, me));
    if (!reads_ordered)
      fail("threadgroup memory race on " + where(i) + ": thread " +
           (m.reader == -2 ? std::string("(several)") : std::to_string(m.reader)) + " read it and thread " +
           std::to_string(me) + " wrote it with no barrier between");
    m.writer = me; m.w_tg = r.tg_epoch; m.w_sg = r.sg_epoch[simd];
    m.reader = -1;
    if (m.early >= 0)  // ordered before this write (else a race above): it read uninitialized memory
      fail("thread " + std::to_string(m.early) + " read threadgroup memory " + where(i) + " before any thread wrote it");
  }

  // after the group: a read that no write ever followed read uninitialized memory
  void judge_unwritten() {
    for (int i = 0; i < size; ++i)
      if (meta[i].early >= 0 && meta[i].writer == -1 && run().error.empty())
        run().error = "thread " + std::to_string(meta[i].early) + " read threadgroup memory " + where(i) +
                      " that no thread wrote (threadgroup " + std::to_string(run().group) + ")";
  }
};

template <class T> struct tg_ref {
  Region* region; T* data; int i;
  operator T() const { region->read(i); return data[i]; }
  tg_ref& operator=(const T& v) { region->write(i); data[i] = v; return *this; }
  tg_ref& operator=(const tg_ref& o) { T v = T(o); return *this = v; }
  template <class U> tg_ref& operator+=(const U& v) { T x = T(*this); return *this = T(x + v); }
  template <class U> tg_ref& operator-=(const U& v) { T x = T(*this); return *this = T(x - v); }
  template <class U> tg_ref& operator*=(const U& v) { T x = T(*this); return *this = T(x * v); }
  template <class U> tg_ref& operator/=(const U& v) { T x = T(*this); return *this = T(x / v); }
};

template <class T> struct tg_ptr {
  Region* region; T* data; int offset;
  tg_ref<T> operator[](int i) const { return tg_ref<T>{region, data, offset + i}; }
  tg_ref<T> operator*() const { return (*this)[0]; }
  tg_ptr operator+(int k) const { return tg_ptr{region, data, offset + k}; }
};

template <class T, int N> struct tg_array {
  tg_array() = default;
  tg_array(const tg_array&) = delete;  // threadgroup memory is passed as a pointer, never copied
  T data[N];
  Meta meta[N];
  Region region;
  tg_array& bind(const char* name) {
    Run& r = run();
    if (region.serial != r.serial) {
      region.name = name; region.size = N; region.meta = meta; region.serial = r.serial;
      for (int i = 0; i < N; ++i) meta[i] = Meta();
      r.regions.push_back(&region);
    }
    return *this;
  }
  tg_ref<T> operator[](int i) { return tg_ref<T>{&region, data, i}; }
  tg_ptr<T> operator+(int k) { return tg_ptr<T>{&region, data, k}; }
  operator tg_ptr<T>() { return tg_ptr<T>{&region, data, 0}; }
};

// Runs one threadgroup to completion; false (with run().error set) on an error.
inline bool run_group(uint g) {
  Run& r = run();
  std::vector<Fiber>& fs = fibers();
  uint n = r.group_size;
  r.group = g;
  r.serial += 1;
  r.tg_epoch = 0;
  r.regions.clear();
  for (auto& e : r.sg_epoch) e = 0;
  for (uint i = 0; i < n; ++i) { fs[i].state = RUNNABLE; fs[i].lid = i; }
  for (;;) {
    for (uint i = 0; i < n; ++i) {
      if (fs[i].state == RUNNABLE) resume(&fs[i]);
      if (!r.error.empty()) return false;
    }
    bool resolved = false;
    uint done = 0, barrier = 0;
    for (uint s = 0; s * SIMD < n; ++s) {
      uint lo = s * SIMD, hi = std::min(n, lo + SIMD), waiting = 0;
      for (uint i = lo; i < hi; ++i) waiting += fs[i].state == WAIT_SIMD;
      if (waiting == 0) continue;
      if (waiting != hi - lo) continue;  // judged below, once nothing else can move
      Fiber* lanes[SIMD];
      for (uint i = lo; i < hi; ++i) {
        lanes[i - lo] = &fs[i];
        if (fs[i].op != fs[lo].op) {
          r.error = "lanes " + std::to_string(lo) + " and " + std::to_string(i) + " of simdgroup " +
                    std::to_string(s) + " wait at different simdgroup functions (divergent control flow)" +
                    " (threadgroup " + std::to_string(g) + ")";
          return false;
        }
      }
      fs[lo].op(lanes, int(hi - lo));
      for (uint i = lo; i < hi; ++i) fs[i].state = RUNNABLE;
      resolved = true;
    }
    if (resolved) continue;
    for (uint i = 0; i < n; ++i) { done += fs[i].state == DONE; barrier += fs[i].state == WAIT_BARRIER; }
    if (done == n) {
      for (Region* region : r.regions) region->judge_unwritten();
      return r.error.empty();
    }
    if (barrier == n) {
      r.tg_epoch += 1;
      for (uint i = 0; i < n; ++i) fs[i].state = RUNNABLE;
      continue;
    }
    // something waits that can never be released: name a waiting thread and one that is elsewhere
    uint w = 0, o = 0;
    for (uint i = 0; i < n; ++i) if (fs[i].state != DONE) { w = i; break; }
    for (uint i = 0; i < n; ++i) if (fs[i].state != fs[w].state) { o = i; break; }
    r.error = "thread " + std::to_string(w) + " " + state_name(fs[w].state) + " while thread " +
              std::to_string(o) + " " + state_name(fs[o].state) +
              " (a barrier or simdgroup function not reached by every thread) (threadgroup " + std::to_string(g) + ")";
    return false;
  }
}

// Runs a dispatch of `groups` threadgroups of `group_size` threads; 0, or 1 with `err` filled.
inline int dispatch(Launch launch, void* const* buffers, uint groups, uint group_size, char* err, int errlen) {
  Run& r = run();
  if (group_size == 0 || group_size > 1024) {
    std::snprintf(err, errlen, "threadgroup size %u outside 1..1024", group_size);
    return 1;
  }
  r.launch = launch; r.buffers = buffers; r.groups = groups; r.group_size = group_size; r.error.clear();
  if (!fibers_valid()) { init_fibers(1024); fibers_valid() = true; }
  for (uint g = 0; g < groups; ++g) {
    if (!run_group(g)) {
      fibers_valid() = false;  // fibers left inside the kernel: started afresh next time
      std::snprintf(err, errlen, "%s", r.error.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace emu

// ---- the Metal standard library subset ------------------------------------------------------
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
inline void threadgroup_barrier(mem_flags) { emu::block(emu::WAIT_BARRIER); }
inline void simdgroup_barrier(mem_flags) { emu::collective(emu::sg_barrier_op, nullptr, nullptr); }

#define KPT_SIMD_FN(name, op)                                                             \
  template <class T> inline T name(T v) { T r; emu::collective(emu::Ops<T>::op, &v, &r); return r; }
KPT_SIMD_FN(simd_sum, sum)
KPT_SIMD_FN(simd_max, max)
KPT_SIMD_FN(simd_min, min)
KPT_SIMD_FN(simd_prefix_exclusive_sum, prefix_exclusive_sum)
KPT_SIMD_FN(simd_prefix_inclusive_sum, prefix_inclusive_sum)
#undef KPT_SIMD_FN
#define KPT_SIMD_SHUFFLE(name, op)                                                        \
  template <class T> inline T name(T v, ushort k) { T r; emu::collective(emu::Ops<T>::op, &v, &r, int(k)); return r; }
KPT_SIMD_SHUFFLE(simd_shuffle, shuffle)
KPT_SIMD_SHUFFLE(simd_broadcast, shuffle)
KPT_SIMD_SHUFFLE(simd_shuffle_xor, shuffle_xor)
KPT_SIMD_SHUFFLE(simd_shuffle_down, shuffle_down)
KPT_SIMD_SHUFFLE(simd_shuffle_up, shuffle_up)
#undef KPT_SIMD_SHUFFLE

// ---- simdgroup matrices (8x8): every lane holds the whole matrix; the product is collective ----
struct ulong2 {
  ulong x, y;
  ulong2(ulong a = 0, ulong b = 0) : x(a), y(b) {}
};

template <class T, int R, int C> struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "the emulator has 8x8 simdgroup matrices only");
  T e[64];
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;

template <class T, int R, int C> inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, R, C> m;
  for (int i = 0; i < 64; ++i) m.e[i] = v;
  return m;
}

// the raw elements behind a matrix function's pointer: a device pointer as it is; threadgroup
// memory after a bounds check of the block, with the race check recording the calling lane's
// share of the elements only (lane l: elements 2l and 2l + 1, row-major), as the GPU's lanes read
template <class T> inline const T* mat_source(const T* src, long, long, const long*) { return src; }
template <class T> inline const T* mat_source(emu::tg_ptr<T> src, long lo, long hi, const long* own) {
  src.region->check(src.offset + int(lo));
  src.region->check(src.offset + int(hi));
  for (int k = 0; k < 2; ++k) src.region->read(src.offset + int(own[k]));
  return src.data + src.offset;
}

// m(r, c) = src[(origin.y + r) · stride + origin.x + c], or the transpose of that block; every lane
// holds the whole matrix
template <class T, class P>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& m, P src, ulong stride = 8, ulong2 origin = ulong2(0, 0),
                           bool transpose = false) {
  long at[64];
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 8; ++c)
      at[r * 8 + c] = (long(origin.y) + (transpose ? c : r)) * long(stride) + long(origin.x) + (transpose ? r : c);
  int lane = int(emu::current()->lid % emu::SIMD);
  long own[2] = {at[2 * lane], at[2 * lane + 1]};
  const auto* data = mat_source(src, at[0], at[63], own);
  for (int e = 0; e < 64; ++e) m.e[e] = T(data[at[e]]);
}

// each lane stores its share of the elements (lane l: elements 2l and 2l + 1 in row-major order)
template <class T, class P>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, P dst, ulong stride = 8, ulong2 origin = ulong2(0, 0),
                            bool transpose = false) {
  int lane = int(emu::current()->lid % emu::SIMD);
  for (int e = 2 * lane; e < 2 * lane + 2 && e < 64; ++e) {
    int r = e / 8, c = e % 8;
    long row = long(origin.y) + (transpose ? c : r), col = long(origin.x) + (transpose ? r : c);
    dst[row * long(stride) + col] = m.e[r * 8 + c];
  }
}

namespace emu {
template <class T> struct MatOps {
  typedef simdgroup_matrix<T, 8, 8> M;
  struct Args { const M* a; const M* b; const M* c; };
  static void mma(Fiber** l, int n) {
    const Args* first = static_cast<const Args*>(l[0]->in);
    for (int i = 1; i < n; ++i) {
      const Args* other = static_cast<const Args*>(l[i]->in);
      if (std::memcmp(other->a, first->a, sizeof(M)) || std::memcmp(other->b, first->b, sizeof(M)) ||
          std::memcmp(other->c, first->c, sizeof(M))) {
        if (run().error.empty())
          run().error = "lanes 0 and " + std::to_string(i) + " of a simdgroup multiply different matrices " +
                        "(simdgroup_multiply_accumulate must be uniform) (threadgroup " + std::to_string(run().group) + ")";
        return;
      }
    }
    M d;
    for (int r = 0; r < 8; ++r)
      for (int c = 0; c < 8; ++c) {
        float acc = float(first->c->e[r * 8 + c]);
        for (int k = 0; k < 8; ++k) acc += float(first->a->e[r * 8 + k]) * float(first->b->e[k * 8 + c]);
        d.e[r * 8 + c] = T(acc);
      }
    for (int i = 0; i < n; ++i) *static_cast<M*>(l[i]->out) = d;
  }
};
}  // namespace emu

// d = a · b + c, computed once for the simdgroup (every lane must pass the same matrices)
template <class T>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<T, 8, 8>& a,
                                          const simdgroup_matrix<T, 8, 8>& b, const simdgroup_matrix<T, 8, 8>& c) {
  typename emu::MatOps<T>::Args args{&a, &b, &c};
  simdgroup_matrix<T, 8, 8> out;
  emu::collective(emu::MatOps<T>::mma, &args, &out);
  d = out;
}

namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float log2(float x) { return std::log2(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float tanh(float x) { return std::tanh(x); }
inline float divide(float a, float b) { return a / b; }
}  // namespace precise

inline float fabs(float x) { return std::fabs(x); }
inline float abs(float x) { return std::fabs(x); }
inline int abs(int x) { return x < 0 ? -x : x; }
inline float floor(float x) { return std::floor(x); }
inline float ceil(float x) { return std::ceil(x); }
inline float rint(float x) { return std::nearbyint(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float copysign(float a, float b) { return std::copysign(a, b); }
inline float ldexp(float x, int e) { return std::ldexp(x, e); }
inline float frexp(float x, int& e) { return std::frexp(x, &e); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
inline bool signbit(float x) { return std::signbit(x); }
// Metal's fmax/fmin and max/min on floats return the other operand for a NaN
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline float clamp(float x, float lo, float hi) { return std::fmin(std::fmax(x, lo), hi); }
inline int clamp(int x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : x; }
inline long clamp(long x, long lo, long hi) { return x < lo ? lo : x > hi ? hi : x; }
template <class T> inline T select(T a, T b, bool c) { return c ? b : a; }

}  // namespace mtl

namespace metal {
using namespace ::mtl;
namespace precise = ::mtl::precise;
}  // namespace metal

using mtl::half;
using mtl::as_type;

// Metal's address-space qualifiers and argument attributes. An attribute becomes
// [[maybe_unused]]; any other attribute is an unknown one, which the build rejects.
#define kernel
#define device
#define constant const
#define thread
#define buffer(n) maybe_unused
#define thread_position_in_grid maybe_unused
#define thread_position_in_threadgroup maybe_unused
#define threadgroup_position_in_grid maybe_unused
#define threads_per_threadgroup maybe_unused
#define threadgroups_per_grid maybe_unused
#define thread_index_in_simdgroup maybe_unused
#define simdgroup_index_in_threadgroup maybe_unused
#define simdgroups_per_threadgroup maybe_unused
#define threads_per_simdgroup maybe_unused
#define threads_per_grid maybe_unused
#define KPT_THREADGROUP(T, name, n) \
  static thread_local ::mtl::emu::tg_array<T, (n)> name##_kpt_storage; auto& name = name##_kpt_storage.bind(#name)
