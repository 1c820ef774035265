/* DLUA_CPU_CLONES: compile a hot CPU loop for AVX-512, AVX2 and baseline x86-64, picked at load time. */
#ifndef DLUA_CPU_CLONES_H
#define DLUA_CPU_CLONES_H

/* The build targets baseline x86-64; wider loads keep streaming loops at memory speed. OpenMP's
   outlined loop bodies are not cloned (GCC outlines them before it clones), so a parallel loop
   calls a cloned function for each of its pieces. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define DLUA_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DLUA_CPU_CLONES
#endif

#endif
