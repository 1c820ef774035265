/* cuemu_rewrite IN OUT: turns a .cu file into C++ for the CUDA emulator. Each launch
     kernel<T, 4><<<grid, block, shmem, stream>>>(a, b);
   becomes
     ::cuemu::launch(::cuemu::Cfg(grid, block, shmem, stream), #kernel<T, 4>#, kernel<T, 4>, a, b);
   Everything else is copied as it is; comments, strings and character literals are skipped while searching, and
   a #line directive keeps compiler messages pointing at the .cu file. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *src;
static size_t n;

static void die(const char *in, size_t at, const char *why) {
  int line = 1;
  for (size_t i = 0; i < at && i < n; i++) line += src[i] == '\n';
  fprintf(stderr, "%s:%d: cuemu_rewrite: %s\n", in, line, why);
  exit(1);
}

/* Index just past a comment, string or character literal starting at i, or i when none starts there. */
static size_t skip_lexeme(size_t i) {
  if (src[i] == '/' && i + 1 < n && src[i + 1] == '/') {
    while (i < n && src[i] != '\n') i++;
    return i;
  }
  if (src[i] == '/' && i + 1 < n && src[i + 1] == '*') {
    const char *e = strstr(src + i + 2, "*/");
    return e ? (size_t)(e - src) + 2 : n;
  }
  if (src[i] == '"' || src[i] == '\'') {
    const char q = src[i++];
    while (i < n && src[i] != q) i += src[i] == '\\' ? 2 : 1;
    return i + 1;
  }
  return i;
}

/* From i at parenthesis depth `depth`: the index of `stop` at depth 0 (stop NULL: of the ')' that closes depth 1),
   skipping comments and literals; n when there is none. */
static size_t scan(size_t i, int depth, const char *stop) {
  while (i < n) {
    size_t s = skip_lexeme(i);
    if (s != i) {
      i = s;
      continue;
    }
    if (stop && depth == 0 && strncmp(src + i, stop, strlen(stop)) == 0) return i;
    if (src[i] == '(') depth++;
    if (src[i] == ')' && --depth == 0 && !stop) return i;
    i++;
  }
  return n;
}

static int ident(char c) { return c == '_' || c == ':' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: cuemu_rewrite IN.cu OUT.cc\n");
    return 2;
  }
  FILE *f = fopen(argv[1], "rb");
  if (!f) {
    perror(argv[1]);
    return 1;
  }
  fseek(f, 0, SEEK_END);
  n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  src = malloc(n + 1);
  if (!src || fread(src, 1, n, f) != n) die(argv[1], 0, "cannot read");
  src[n] = 0;
  fclose(f);

  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", argv[2]);
  FILE *o = fopen(tmp, "wb");
  if (!o) {
    perror(tmp);
    return 1;
  }
  fprintf(o, "#line 1 \"%s\"\n", argv[1]);
  size_t done = 0; /* src[0, done) is written */
  for (size_t i = 0; i < n;) {
    size_t j = skip_lexeme(i);
    if (j != i) {
      i = j;
      continue;
    }
    if (strncmp(src + i, "<<<", 3) != 0) {
      i++;
      continue;
    }
    /* The kernel expression: identifiers and :: , optionally followed by balanced template arguments. */
    size_t ke = i;
    while (ke > done && (src[ke - 1] == ' ' || src[ke - 1] == '\t')) ke--;
    size_t ks = ke;
    if (ks > done && src[ks - 1] == '>') {
      int depth = 0;
      do {
        ks--;
        if (src[ks] == '>') depth++;
        else if (src[ks] == '<') depth--;
      } while (ks > done && depth > 0);
      if (depth) die(argv[1], i, "unbalanced template arguments before <<<");
    }
    while (ks > done && ident(src[ks - 1])) ks--;
    if (ks == ke) die(argv[1], i, "no kernel name before <<<");
    /* The configuration up to >>> at parenthesis depth 0, then the arguments up to their ')'. */
    size_t cs = i + 3, ce = scan(cs, 0, ">>>");
    if (ce >= n) die(argv[1], i, "no >>> after <<<");
    size_t as = ce + 3;
    while (as < n && (src[as] == ' ' || src[as] == '\t' || src[as] == '\n')) as++;
    if (as >= n || src[as] != '(') die(argv[1], i, "no argument list after >>>");
    size_t ae = scan(as + 1, 1, NULL);
    if (ae >= n) die(argv[1], i, "unbalanced kernel arguments");
    ae++; /* just past the closing parenthesis */
    fwrite(src + done, 1, ks - done, o);
    fputs("::cuemu::launch(::cuemu::Cfg(", o);
    fwrite(src + cs, 1, ce - cs, o);
    fputs("), \"", o);
    for (size_t k = ks; k < ke; k++)
      if (src[k] != '\n' && src[k] != '"') fputc(src[k], o);
    fputs("\", ", o);
    fwrite(src + ks, 1, ke - ks, o);
    size_t a0 = as + 1;
    while (a0 < ae - 1 && (src[a0] == ' ' || src[a0] == '\n' || src[a0] == '\t')) a0++;
    if (a0 < ae - 1) fputs(", ", o);
    fwrite(src + as + 1, 1, ae - as - 1, o); /* the arguments and the closing parenthesis */
    /* keep line numbers: the launch may have spanned lines; they are all still written */
    done = ae;
    i = ae;
  }
  fwrite(src + done, 1, n - done, o);
  if (fclose(o) != 0 || rename(tmp, argv[2]) != 0) {
    perror(argv[2]);
    return 1;
  }
  return 0;
}
