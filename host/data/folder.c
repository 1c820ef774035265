/* ImageFolder scanning (torchvision's order: classes sorted, files sorted by folder then name) and the on-disk cache of the list. */
#include "data/folder.h"
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>
#include "core/error.h"
#include "core/runtime.h"

static const char OP[] = "ImageFolder";
static const char MAGIC[] = "dlua-imagefolder 1";
/* Symbolic links are followed (as torchvision's os.walk(followlinks=True)); a loop of them
   stops here instead of running forever. */
enum { MAX_DEPTH = 32 };

/* ---- growable lists ---------------------------------------------------------------------------- */

typedef struct {
  char **v;
  int64_t n, cap;
} strs_t;

static int strs_push(strs_t *s, char *x) {
  if (!x) return 0;
  if (s->n == s->cap) {
    int64_t c = s->cap ? 2 * s->cap : 64;
    char **v = realloc(s->v, (size_t)c * sizeof *v);
    if (!v) {
      free(x);
      return 0;
    }
    s->v = v;
    s->cap = c;
  }
  s->v[s->n++] = x;
  return 1;
}

static void strs_free(strs_t *s) {
  for (int64_t i = 0; i < s->n; i++) free(s->v[i]);
  free(s->v);
  memset(s, 0, sizeof *s);
}

typedef struct {
  char *dir;  /* folder, relative to the root */
  char *name;
} entry_t;

typedef struct {
  entry_t *v;
  int64_t n, cap;
} entries_t;

/* A visited folder and its mtime, the cache's validity key. */
typedef struct {
  char *rel;
  int64_t sec, nsec;
} dirstamp_t;

typedef struct {
  dirstamp_t *v;
  int64_t n, cap;
} dirs_t;

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int cmp_entry(const void *a, const void *b) {
  const entry_t *x = a, *y = b;
  int c = strcmp(x->dir, y->dir);
  return c ? c : strcmp(x->name, y->name);
}

/* The extensions decoded here (case-insensitive); other files are not part of the dataset,
   as torchvision leaves out files whose extension it does not know. */
static int is_image_name(const char *name) {
  const char *dot = strrchr(name, '.');
  if (!dot) return 0;
  return !strcasecmp(dot, ".jpg") || !strcasecmp(dot, ".jpeg") || !strcasecmp(dot, ".png");
}

static char *join(const char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b);
  char *r = malloc(la + lb + 2);
  if (!r) return NULL;
  memcpy(r, a, la);
  size_t k = la;
  if (la && lb) r[k++] = '/';
  memcpy(r + k, b, lb + 1);
  return r;
}

/* ---- scanning ----------------------------------------------------------------------------------- */

typedef struct {
  const char *root;
  entries_t files;
  dirs_t dirs;
  int oom;
} scan_t;

static int note_dir(scan_t *s, const char *rel, const struct stat *st) {
  if (s->dirs.n == s->dirs.cap) {
    int64_t c = s->dirs.cap ? 2 * s->dirs.cap : 64;
    dirstamp_t *v = realloc(s->dirs.v, (size_t)c * sizeof *v);
    if (!v) return 0;
    s->dirs.v = v;
    s->dirs.cap = c;
  }
  char *r = strdup(rel);
  if (!r) return 0;
  s->dirs.v[s->dirs.n++] = (dirstamp_t){r, (int64_t)st->st_mtim.tv_sec, (int64_t)st->st_mtim.tv_nsec};
  return 1;
}

static int add_file(scan_t *s, const char *dir, const char *name) {
  if (s->files.n == s->files.cap) {
    int64_t c = s->files.cap ? 2 * s->files.cap : 1024;
    entry_t *v = realloc(s->files.v, (size_t)c * sizeof *v);
    if (!v) return 0;
    s->files.v = v;
    s->files.cap = c;
  }
  entry_t e = {strdup(dir), strdup(name)};
  if (!e.dir || !e.name) {
    free(e.dir);
    free(e.name);
    return 0;
  }
  s->files.v[s->files.n++] = e;
  return 1;
}

/* Every image under root/rel, recursively. */
static dlua_status_t walk(scan_t *s, const char *rel, int depth) {
  char *abs = join(s->root, rel);
  if (!abs) return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory scanning '%s'", OP, s->root);
  DIR *d = opendir(abs);
  if (!d) {
    dlua_status_t st = DLUA_ERR(DLUA_ERR_IO, "%s: cannot read folder '%s': %s", OP, abs, strerror(errno));
    free(abs);
    return st;
  }
  struct stat dst;
  if (fstat(dirfd(d), &dst) != 0 || !note_dir(s, rel, &dst)) {
    closedir(d);
    free(abs);
    return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory scanning '%s'", OP, s->root);
  }
  strs_t subdirs = {0};
  dlua_status_t st = DLUA_OK;
  struct dirent *e;
  while (st == DLUA_OK && (e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    int isdir = e->d_type == DT_DIR, isreg = e->d_type == DT_REG;
    if (e->d_type == DT_LNK || e->d_type == DT_UNKNOWN) {
      char *p = join(abs, e->d_name);
      struct stat fst;
      if (p && stat(p, &fst) == 0) {
        isdir = S_ISDIR(fst.st_mode);
        isreg = S_ISREG(fst.st_mode);
      }
      free(p);
    }
    if (isdir) {
      if (!strs_push(&subdirs, join(rel, e->d_name))) st = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory scanning", OP);
    } else if (isreg && is_image_name(e->d_name)) {
      if (!add_file(s, rel, e->d_name)) st = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory scanning", OP);
    }
    if (dlua_interrupt_flag) st = DLUA_ERR(DLUA_ERR_INTERRUPTED, "%s: interrupted scanning '%s'", OP, s->root);
  }
  closedir(d);
  free(abs);
  if (depth < MAX_DEPTH)
    for (int64_t i = 0; i < subdirs.n && st == DLUA_OK; i++) st = walk(s, subdirs.v[i], depth + 1);
  strs_free(&subdirs);
  return st;
}

static void scan_free(scan_t *s) {
  for (int64_t i = 0; i < s->files.n; i++) {
    free(s->files.v[i].dir);
    free(s->files.v[i].name);
  }
  free(s->files.v);
  for (int64_t i = 0; i < s->dirs.n; i++) free(s->dirs.v[i].rel);
  free(s->dirs.v);
}

/* ---- the folder object ------------------------------------------------------------------------- */

void dlua_folder_retain(dlua_folder_t *f) {
  if (f) __atomic_add_fetch(&f->refcount, 1, __ATOMIC_RELAXED);
}

void dlua_folder_free(dlua_folder_t *f) {
  if (!f || __atomic_sub_fetch(&f->refcount, 1, __ATOMIC_ACQ_REL) > 0) return;
  for (int c = 0; c < f->nclasses; c++) free(f->classes[c]);
  free(f->classes);
  for (int64_t i = 0; i < f->n; i++) free(f->paths[i]);
  free(f->paths);
  free(f->labels);
  free(f->root);
  free(f->cache_path);
  free(f);
}

int64_t dlua_folder_size(const dlua_folder_t *f) { return f ? f->n : 0; }
int dlua_folder_num_classes(const dlua_folder_t *f) { return f ? f->nclasses : 0; }
const char *dlua_folder_root(const dlua_folder_t *f) { return f ? f->root : NULL; }
int dlua_folder_cached(const dlua_folder_t *f) { return f ? f->from_cache : 0; }
const char *dlua_folder_cache_path(const dlua_folder_t *f) { return f ? f->cache_path : NULL; }
const char *dlua_folder_class(const dlua_folder_t *f, int c) {
  return (f && c >= 0 && c < f->nclasses) ? f->classes[c] : NULL;
}
const char *dlua_folder_file(const dlua_folder_t *f, int64_t i) { return (f && i >= 0 && i < f->n) ? f->paths[i] : NULL; }
int dlua_folder_label(const dlua_folder_t *f, int64_t i) { return (f && i >= 0 && i < f->n) ? f->labels[i] : -1; }

char *dlua_folder_full_path(const dlua_folder_t *f, int64_t i, char **buf, size_t *cap) {
  size_t lr = strlen(f->root), lp = strlen(f->paths[i]), need = lr + lp + 2;
  if (need > *cap) {
    char *b = realloc(*buf, need + 64);
    if (!b) return NULL;
    *buf = b;
    *cap = need + 64;
  }
  memcpy(*buf, f->root, lr);
  (*buf)[lr] = '/';
  memcpy(*buf + lr + 1, f->paths[i], lp + 1);
  return *buf;
}

/* ---- the cache file ---------------------------------------------------------------------------- */

/* FNV-1a of the root's real path: the cache file's name. */
static uint64_t fnv1a(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
  return h;
}

static char *default_cache_dir(void) {
  const char *x = getenv("XDG_CACHE_HOME");
  if (x && x[0] == '/') return join(x, "dlua/imagefolder");
  const char *home = getenv("HOME");
  if (home && home[0] == '/') return join(home, ".cache/dlua/imagefolder");
  return NULL;
}

static int mkdirs(const char *path) {
  char *p = strdup(path);
  if (!p) return -1;
  for (char *q = p + 1; *q; q++) {
    if (*q != '/') continue;
    *q = '\0';
    if (mkdir(p, 0755) != 0 && errno != EEXIST) {
      free(p);
      return -1;
    }
    *q = '/';
  }
  int r = (mkdir(p, 0755) == 0 || errno == EEXIST) ? 0 : -1;
  free(p);
  return r;
}

/* Reads a line without its newline into *buf; 0 at end of file or on OOM. */
static int read_line(FILE *f, char **buf, size_t *cap) {
  ssize_t n = getline(buf, cap, f);
  if (n <= 0) return 0;
  if ((*buf)[n - 1] == '\n') (*buf)[n - 1] = '\0';
  return 1;
}

/* Loads the list from the cache when every folder recorded there still has its recorded
   mtime (a file added, removed or renamed changes its folder's mtime); 0 when there is no
   usable cache, which is never an error. */
static int cache_load(dlua_folder_t *f, const char *path) {
  FILE *fp = fopen(path, "r");
  if (!fp) return 0;
  char *line = NULL;
  size_t cap = 0;
  int ok = 0;
  int64_t ndirs = 0, nfiles = 0;
  int ncls = 0;
  if (!read_line(fp, &line, &cap) || strcmp(line, MAGIC)) goto done;
  if (!read_line(fp, &line, &cap) || strncmp(line, "root ", 5) || strcmp(line + 5, f->root)) goto done;
  if (!read_line(fp, &line, &cap) || sscanf(line, "dirs %" SCNd64, &ndirs) != 1 || ndirs < 1) goto done;
  for (int64_t i = 0; i < ndirs; i++) {
    int64_t sec, nsec;
    int off = 0;
    if (!read_line(fp, &line, &cap) || sscanf(line, "%" SCNd64 " %" SCNd64 " %n", &sec, &nsec, &off) != 2) goto done;
    const char *rel = line + off;
    char *abs = join(f->root, strcmp(rel, ".") ? rel : "");
    struct stat st;
    int same = abs && stat(abs, &st) == 0 && S_ISDIR(st.st_mode) && st.st_mtim.tv_sec == sec && st.st_mtim.tv_nsec == nsec;
    free(abs);
    if (!same) goto done;
  }
  if (!read_line(fp, &line, &cap) || sscanf(line, "classes %d", &ncls) != 1 || ncls < 1) goto done;
  f->classes = calloc((size_t)ncls, sizeof(char *));
  if (!f->classes) goto done;
  for (f->nclasses = 0; f->nclasses < ncls; f->nclasses++) {
    if (!read_line(fp, &line, &cap) || !(f->classes[f->nclasses] = strdup(line))) goto done;
  }
  if (!read_line(fp, &line, &cap) || sscanf(line, "files %" SCNd64, &nfiles) != 1 || nfiles < 1) goto done;
  f->paths = calloc((size_t)nfiles, sizeof(char *));
  f->labels = malloc((size_t)nfiles * sizeof(int32_t));
  if (!f->paths || !f->labels) goto done;
  for (f->n = 0; f->n < nfiles; f->n++) {
    int label = -1, off = 0;
    if (!read_line(fp, &line, &cap) || sscanf(line, "%d %n", &label, &off) != 1 || label < 0 || label >= ncls) goto done;
    if (!(f->paths[f->n] = strdup(line + off))) goto done;
    f->labels[f->n] = label;
  }
  ok = 1;
done:
  free(line);
  fclose(fp);
  if (!ok) {  // back to an empty object: the caller scans
    for (int c = 0; c < f->nclasses; c++) free(f->classes[c]);
    free(f->classes);
    for (int64_t i = 0; i < f->n; i++) free(f->paths[i]);
    free(f->paths);
    free(f->labels);
    f->classes = NULL;
    f->paths = NULL;
    f->labels = NULL;
    f->nclasses = 0;
    f->n = 0;
  }
  return ok;
}

/* Writes the list (temporary file, then rename); failures only cost the next run a scan. */
static void cache_store(const dlua_folder_t *f, const dirs_t *dirs, const char *path) {
  for (int64_t i = 0; i < f->n; i++)
    if (strchr(f->paths[i], '\n')) return;  // one entry per line: such names are not cached
  for (int c = 0; c < f->nclasses; c++)
    if (strchr(f->classes[c], '\n')) return;
  char *slash = strrchr(path, '/');
  if (slash) {
    char *dir = strndup(path, (size_t)(slash - path));
    int r = dir ? mkdirs(dir) : -1;
    free(dir);
    if (r != 0) return;
  }
  size_t pl = strlen(path);
  char *tmp = malloc(pl + 32);
  if (!tmp) return;
  snprintf(tmp, pl + 32, "%s.tmp.%d", path, (int)getpid());
  FILE *fp = fopen(tmp, "w");
  if (!fp) {
    free(tmp);
    return;
  }
  fprintf(fp, "%s\nroot %s\ndirs %" PRId64 "\n", MAGIC, f->root, dirs->n);
  for (int64_t i = 0; i < dirs->n; i++)
    fprintf(fp, "%" PRId64 " %" PRId64 " %s\n", dirs->v[i].sec, dirs->v[i].nsec, dirs->v[i].rel[0] ? dirs->v[i].rel : ".");
  fprintf(fp, "classes %d\n", f->nclasses);
  for (int c = 0; c < f->nclasses; c++) fprintf(fp, "%s\n", f->classes[c]);
  fprintf(fp, "files %" PRId64 "\n", f->n);
  for (int64_t i = 0; i < f->n; i++) fprintf(fp, "%d %s\n", f->labels[i], f->paths[i]);
  int bad = ferror(fp);
  if (fclose(fp) != 0 || bad || rename(tmp, path) != 0) remove(tmp);
  free(tmp);
}

/* ---- open ------------------------------------------------------------------------------------- */

static dlua_status_t scan_into(dlua_folder_t *f, dirs_t *dirs_out) {
  scan_t s = {.root = f->root};
  struct stat rst;
  dlua_status_t st = DLUA_OK;
  strs_t classes = {0};
  DIR *d = opendir(f->root);
  if (!d) return DLUA_ERR(DLUA_ERR_IO, "%s: cannot read folder '%s': %s", OP, f->root, strerror(errno));
  if (fstat(dirfd(d), &rst) != 0 || !note_dir(&s, "", &rst)) st = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
  struct dirent *e;
  while (st == DLUA_OK && (e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    int isdir = e->d_type == DT_DIR;
    if (e->d_type == DT_LNK || e->d_type == DT_UNKNOWN) {
      char *p = join(f->root, e->d_name);
      struct stat fst;
      isdir = p && stat(p, &fst) == 0 && S_ISDIR(fst.st_mode);
      free(p);
    }
    if (isdir && !strs_push(&classes, strdup(e->d_name))) st = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
  }
  closedir(d);
  if (st == DLUA_OK && classes.n == 0)
    st = DLUA_ERR(DLUA_ERR_ARG, "%s: no class folders in '%s' (expected root/<class>/<image>.jpg)", OP, f->root);
  if (st == DLUA_OK && classes.n > INT32_MAX) st = DLUA_ERR(DLUA_ERR_ARG, "%s: too many classes in '%s'", OP, f->root);
  if (st == DLUA_OK) qsort(classes.v, (size_t)classes.n, sizeof(char *), cmp_str);
  int64_t *first = st == DLUA_OK ? malloc((size_t)(classes.n + 1) * sizeof(int64_t)) : NULL;
  if (st == DLUA_OK && !first) st = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
  for (int64_t c = 0; st == DLUA_OK && c < classes.n; c++) {
    first[c] = s.files.n;
    st = walk(&s, classes.v[c], 1);
    if (st == DLUA_OK && s.files.n == first[c])
      st = DLUA_ERR(DLUA_ERR_ARG, "%s: class folder '%s/%s' holds no image (.jpg, .jpeg or .png)", OP, f->root,
                    classes.v[c]);
    if (st == DLUA_OK)
      qsort(s.files.v + first[c], (size_t)(s.files.n - first[c]), sizeof(entry_t), cmp_entry);
  }
  if (st == DLUA_OK) {
    first[classes.n] = s.files.n;
    f->n = s.files.n;
    f->paths = calloc((size_t)f->n, sizeof(char *));
    f->labels = malloc((size_t)f->n * sizeof(int32_t));
    if (!f->paths || !f->labels) st = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory for %" PRId64 " files", OP, f->n);
    for (int64_t c = 0; st == DLUA_OK && c < classes.n; c++)
      for (int64_t i = first[c]; i < first[c + 1]; i++) {
        f->labels[i] = (int32_t)c;
        if (!(f->paths[i] = join(s.files.v[i].dir, s.files.v[i].name))) {
          st = DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
          break;
        }
      }
  }
  if (st == DLUA_OK) {
    f->nclasses = (int)classes.n;
    f->classes = classes.v;
    memset(&classes, 0, sizeof classes);
    *dirs_out = s.dirs;
    memset(&s.dirs, 0, sizeof s.dirs);
  }
  free(first);
  strs_free(&classes);
  scan_free(&s);
  return st;
}

dlua_status_t dlua_folder_open(dlua_folder_t **out, const char *root, const char *cache_dir) {
  if (!out) return DLUA_ERR(DLUA_ERR_ARG, "%s: out is NULL", OP);
  *out = NULL;
  if (!root || !root[0]) return DLUA_ERR(DLUA_ERR_ARG, "%s: root is empty", OP);
  char real[PATH_MAX];
  struct stat st;
  if (!realpath(root, real) || stat(real, &st) != 0)
    return DLUA_ERR(DLUA_ERR_IO, "%s: cannot open '%s': %s", OP, root, strerror(errno));
  if (!S_ISDIR(st.st_mode)) return DLUA_ERR(DLUA_ERR_ARG, "%s: '%s' is not a folder", OP, root);
  dlua_folder_t *f = calloc(1, sizeof *f);
  if (!f || !(f->root = strdup(real))) {
    free(f);
    return DLUA_ERR(DLUA_ERR_OOM, "%s: out of memory", OP);
  }
  f->refcount = 1;
  if (!cache_dir || cache_dir[0]) {
    char *dir = cache_dir ? strdup(cache_dir) : default_cache_dir();
    if (dir) {
      char name[40];
      snprintf(name, sizeof name, "%016" PRIx64 ".list", fnv1a(f->root));
      f->cache_path = join(dir, name);
      free(dir);
    }
  }
  if (f->cache_path && cache_load(f, f->cache_path)) {
    f->from_cache = 1;
    *out = f;
    return DLUA_OK;
  }
  dirs_t dirs = {0};
  dlua_status_t s = scan_into(f, &dirs);
  if (s == DLUA_OK && f->cache_path) cache_store(f, &dirs, f->cache_path);
  for (int64_t i = 0; i < dirs.n; i++) free(dirs.v[i].rel);
  free(dirs.v);
  if (s != DLUA_OK) {
    dlua_folder_free(f);
    return s;
  }
  *out = f;
  return DLUA_OK;
}
