/* The per-element arithmetic of the fused optimizer steps, written once for the CPU loops (host/cpu/optim.c)
   and the CUDA kernels (host/cuda/optim.cu). Each line mirrors one torch op of _single_tensor_sgd /
   _single_tensor_adam / _single_tensor_adamw (torch 1.13); LAMB follows dlua_optim_lamb_step's
   description in dlua.h; every scalar arrives already rounded to T, as PyTorch passes Python
   floats to its T kernels. */
#ifndef DLUA_KERNELS_OPTIM_OPS_H
#define DLUA_KERNELS_OPTIM_OPS_H
#include <math.h>
#include <stdint.h>
#include "kernels/optim.h"

#ifdef __CUDACC__
#define DLUA_OPT_HD __host__ __device__
#else
#define DLUA_OPT_HD
#endif

/* dlua_opt_args_t, the arguments of one step over a range: host/kernels/optim.h. */

#define DLUA_OPT_STEPS(T, S, SQRT)                                                                              \
  /* d = g * gs (negated when maximizing) + wd * p; momentum; p -= lr * d */                                   \
  static inline DLUA_OPT_HD void dlua_opt_sgd_##S(T *p, T g, T *buf, T gs, T wd, T mom, T damp1, T lr,          \
                                                  int nesterov, int maximize, int first) {                      \
    T d = g * gs;                                                                                               \
    if (maximize) d = -d;                                                                                       \
    if (wd != 0) d = d + wd * *p;           /* d_p.add(param, alpha=wd) */                                      \
    if (mom != 0) {                                                                                             \
      T b = first ? d : *buf * mom + damp1 * d; /* buf.mul_(momentum).add_(d_p, alpha=1-dampening) */          \
      *buf = b;                                                                                                 \
      d = nesterov ? d + mom * b : b;                                                                           \
    }                                                                                                           \
    *p = *p - lr * d;                                                                                           \
  }                                                                                                             \
  /* Adam and AdamW, one body: AdamW passes decay = 1 - lr * wd and l2 = 0 (decoupled decay), Adam decay = 1  \
     (exact) and l2 = wd (L2 coupled into the gradient). */                                                    \
  static inline DLUA_OPT_HD void dlua_opt_adam_##S(T *p, T g, T *m, T *v, T *vmax, T gs, T decay, T l2, T b1,   \
                                                   T omb1, T b2, T omb2, T neg_step, T bc2_sqrt, T eps,         \
                                                   int maximize, int amsgrad) {                                 \
    T gr = g * gs;                                                                                              \
    if (maximize) gr = -gr;                                                                                     \
    if (l2 != 0) gr = gr + l2 * *p;          /* Adam: grad = grad.add(param, alpha=weight_decay) */             \
    T pw = *p * decay;                       /* AdamW: param.mul_(1 - lr * weight_decay) */                     \
    T mi = *m * b1 + omb1 * gr;              /* exp_avg.mul_(beta1).add_(grad, alpha=1-beta1) */                \
    T vi = *v * b2 + omb2 * gr * gr;         /* exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1-beta2) */         \
    *m = mi;                                                                                                    \
    *v = vi;                                                                                                    \
    if (amsgrad) {                           /* torch.maximum: NaN wins */                                      \
      T mx = *vmax;                                                                                             \
      vi = (mx > vi || mx != mx) ? mx : vi;                                                                     \
      *vmax = vi;                                                                                               \
    }                                                                                                           \
    T denom = SQRT(vi) / bc2_sqrt + eps;                                                                        \
    *p = pw + neg_step * (mi / denom);       /* param.addcdiv_(exp_avg, denom, value=-step_size) */             \
  }                                                                                                             \
  /* LAMB's update direction u = (m / bc1) / (sqrt(v / bc2) + eps) + wd * p (bc = 1 without bias             \
     correction: exact). Pass 1 folds |p|^2 and |u|^2 per parameter, pass 2 recomputes u from the stored    \
     moments (the same bits) and applies p -= lr * trust * u, so no buffer holds u. */                       \
  static inline DLUA_OPT_HD T dlua_opt_lamb_dir_##S(T p, T m, T v, T bc1, T bc2, T eps, T wd) {                 \
    T u = (m / bc1) / (SQRT(v / bc2) + eps);                                                                    \
    if (wd != 0) u = u + wd * p;                                                                                \
    return u;                                                                                                   \
  }                                                                                                             \
  static inline DLUA_OPT_HD T dlua_opt_lamb_moments_##S(T p, T g, T *m, T *v, T gs, T b1, T omb1, T b2, T omb2,  \
                                                        T bc1, T bc2, T eps, T wd) {                            \
    T gr = g * gs;                                                                                              \
    T mi = *m * b1 + omb1 * gr;                                                                                 \
    T vi = *v * b2 + omb2 * gr * gr;                                                                            \
    *m = mi;                                                                                                    \
    *v = vi;                                                                                                    \
    return dlua_opt_lamb_dir_##S(p, mi, vi, bc1, bc2, eps, wd);                                                 \
  }                                                                                                             \
  static inline DLUA_OPT_HD void dlua_opt_lamb_apply_##S(T *p, T m, T v, T neg_lr_trust, T bc1, T bc2, T eps,   \
                                                         T wd) {                                                \
    *p = *p + neg_lr_trust * dlua_opt_lamb_dir_##S(*p, m, v, bc1, bc2, eps, wd);                                \
  }                                                                                                             \
  /* NVIDIA's LARC: grad += wd * p; grad *= trust; then SGD with momentum (no dampening). */                   \
  static inline DLUA_OPT_HD void dlua_opt_lars_##S(T *p, T g, T *buf, T gs, T wd, T trust, T mom, T lr,         \
                                                   int first) {                                                 \
    T d = g * gs;                                                                                               \
    if (wd != 0) d = d + wd * *p;                                                                               \
    d = d * trust;                                                                                              \
    if (mom != 0) {                                                                                             \
      T b = first ? d : *buf * mom + d;                                                                         \
      *buf = b;                                                                                                 \
      d = b;                                                                                                    \
    }                                                                                                           \
    *p = *p - lr * d;                                                                                           \
  }

DLUA_OPT_STEPS(float, f, sqrtf)
DLUA_OPT_STEPS(double, d, sqrt)

/* clip_grad_norm_'s per-element terms, accumulated in double whatever the gradient's dtype: |g|^p for a
   finite p (p = 2 and 1 without pow), and the running max of |g| for p = inf, where NaN wins as in
   torch's max. */
static inline DLUA_OPT_HD double dlua_opt_norm_term(double g, double p) {
  const double a = fabs(g);
  return p == 2 ? a * a : p == 1 ? a : pow(a, p);
}
static inline DLUA_OPT_HD double dlua_opt_norm_max(double m, double g) {
  const double a = fabs(g);
  return (a > m || a != a) ? a : m;
}

#endif
