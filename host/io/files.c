/* File-system helpers for checkpoints: temporary names, full writes, atomic small files, directory listing and removal. */
#include "io/files.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include "core/error.h"
#include "core/tensor.h"

static unsigned temp_counter;

char *dlua_io_dirname(const char *path) {
  const char *slash = strrchr(path, '/');
  char *d;
  if (!slash) {
    d = strdup(".");
  } else if (slash == path) {
    d = strdup("/");
  } else {
    d = strndup(path, (size_t)(slash - path));
  }
  if (!d) DLUA_ERR(DLUA_ERR_OOM, "out of memory for the name of %s", path);
  return d;
}

char *dlua_io_temp_name(const char *path) {
  const char *slash = strrchr(path, '/');
  size_t dirlen = slash ? (size_t)(slash - path) + 1 : 0;
  const char *base = path + dirlen;
  size_t n = strlen(path) + 64;
  char *t = malloc(n);
  if (!t) {
    DLUA_ERR(DLUA_ERR_OOM, "out of memory for a temporary name beside %s", path);
    return NULL;
  }
  unsigned k = __atomic_add_fetch(&temp_counter, 1, __ATOMIC_RELAXED);
  snprintf(t, n, "%.*s.%s.tmp-%ld-%u", (int)dirlen, path, base, (long)getpid(), k);
  return t;
}

dlua_status_t dlua_io_pwrite_all(int fd, const void *data, size_t n, off_t off, const char *path) {
  const char *p = data;
  while (n > 0) {
    ssize_t w = pwrite(fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n, off);
    if (w < 0) {
      if (errno == EINTR) continue;
      return DLUA_ERR(DLUA_ERR_IO, "writing %s: %s", path, strerror(errno));
    }
    if (w == 0) return DLUA_ERR(DLUA_ERR_IO, "writing %s: the device accepts no more bytes", path);
    p += w;
    n -= (size_t)w;
    off += w;
  }
  return DLUA_OK;
}

dlua_status_t dlua_io_fsync_dir_of(const char *path) {
  char *dir = dlua_io_dirname(path);
  if (!dir) return DLUA_ERR_OOM;
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  dlua_status_t s = DLUA_OK;
  if (fd < 0) {
    s = DLUA_ERR(DLUA_ERR_IO, "opening directory %s to fsync it: %s", dir, strerror(errno));
  } else {
    // Some file systems cannot fsync a directory (EINVAL): the rename is then as durable as they allow.
    if (fsync(fd) != 0 && errno != EINVAL && errno != EROFS)
      s = DLUA_ERR(DLUA_ERR_IO, "fsync of directory %s: %s", dir, strerror(errno));
    close(fd);
  }
  free(dir);
  return s;
}

dlua_status_t dlua_io_publish(const char *tmp, const char *path) {
  if (rename(tmp, path) != 0) {
    dlua_status_t s = DLUA_ERR(DLUA_ERR_IO, "renaming %s to %s: %s", tmp, path, strerror(errno));
    unlink(tmp);
    return s;
  }
  return dlua_io_fsync_dir_of(path);
}

dlua_status_t dlua_io_mkdirs(const char *path) {
  if (!path || !*path) return DLUA_ERR(DLUA_ERR_ARG, "mkdirs: expected a directory name");
  char *p = strdup(path);
  if (!p) return DLUA_ERR(DLUA_ERR_OOM, "mkdirs: out of memory");
  dlua_status_t s = DLUA_OK;
  for (char *c = p + 1;; c++) {
    if (*c == '/' || *c == '\0') {
      char keep = *c;
      *c = '\0';
      if (mkdir(p, 0755) != 0 && errno != EEXIST) {
        s = DLUA_ERR(DLUA_ERR_IO, "creating directory %s: %s", p, strerror(errno));
        break;
      }
      *c = keep;
      if (keep == '\0') break;
    }
  }
  if (s == DLUA_OK) {
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) s = DLUA_ERR(DLUA_ERR_IO, "%s exists and is not a directory", path);
  }
  free(p);
  return s;
}

dlua_status_t dlua_io_list_dir(const char *path, char **names, size_t *len) {
  if (!path || !names || !len) return DLUA_ERR(DLUA_ERR_ARG, "list_dir: NULL argument");
  *names = NULL;
  *len = 0;
  DIR *d = opendir(path);
  if (!d) {
    if (errno == ENOENT) return DLUA_OK;
    return DLUA_ERR(DLUA_ERR_IO, "listing directory %s: %s", path, strerror(errno));
  }
  size_t cap = 256, n = 0;
  char *buf = malloc(cap);
  dlua_status_t s = buf ? DLUA_OK : DLUA_ERR(DLUA_ERR_OOM, "list_dir: out of memory");
  struct dirent *e;
  while (s == DLUA_OK && (e = readdir(d)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    size_t k = strlen(e->d_name) + 1;
    if (n + k > cap) {
      while (n + k > cap) cap *= 2;
      char *nb = realloc(buf, cap);
      if (!nb) {
        s = DLUA_ERR(DLUA_ERR_OOM, "list_dir: out of memory");
        break;
      }
      buf = nb;
    }
    memcpy(buf + n, e->d_name, k);
    n += k;
  }
  closedir(d);
  if (s != DLUA_OK) {
    free(buf);
    return s;
  }
  *names = buf;
  *len = n;
  return DLUA_OK;
}

void dlua_io_free(void *p) { free(p); }

dlua_status_t dlua_io_write_file(const char *path, const char *data, size_t len) {
  if (!path || (!data && len)) return DLUA_ERR(DLUA_ERR_ARG, "write_file: NULL argument");
  char *tmp = dlua_io_temp_name(path);
  if (!tmp) return DLUA_ERR_OOM;
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    dlua_status_t s = DLUA_ERR(DLUA_ERR_IO, "creating %s: %s", tmp, strerror(errno));
    free(tmp);
    return s;
  }
  dlua_status_t s = dlua_io_pwrite_all(fd, data, len, 0, tmp);
  if (s == DLUA_OK && fsync(fd) != 0) s = DLUA_ERR(DLUA_ERR_IO, "fsync of %s: %s", tmp, strerror(errno));
  if (close(fd) != 0 && s == DLUA_OK) s = DLUA_ERR(DLUA_ERR_IO, "closing %s: %s", tmp, strerror(errno));
  if (s == DLUA_OK) {
    s = dlua_io_publish(tmp, path);
  } else {
    unlink(tmp);
  }
  free(tmp);
  return s;
}

dlua_status_t dlua_io_remove_dir(const char *dir) {
  if (!dir || !*dir) return DLUA_ERR(DLUA_ERR_ARG, "remove_dir: expected a directory name");
  char *names = NULL;
  size_t len = 0;
  DLUA_TRY(dlua_io_list_dir(dir, &names, &len));
  dlua_status_t s = DLUA_OK;
  size_t dl = strlen(dir);
  // index.json first: a checkpoint directory stops being complete before any of its files goes,
  // so a removal cut short never leaves something that looks loadable.
  char *index = malloc(dl + 16);
  if (!index) s = DLUA_ERR(DLUA_ERR_OOM, "remove_dir: out of memory");
  if (index) {
    sprintf(index, "%s/index.json", dir);
    if (unlink(index) != 0 && errno != ENOENT) s = DLUA_ERR(DLUA_ERR_IO, "removing %s: %s", index, strerror(errno));
    if (s == DLUA_OK) s = dlua_io_fsync_dir_of(index);
    free(index);
  }
  for (size_t off = 0; off < len && s == DLUA_OK; off += strlen(names + off) + 1) {
    const char *nm = names + off;
    char *p = malloc(dl + strlen(nm) + 2);
    if (!p) {
      s = DLUA_ERR(DLUA_ERR_OOM, "remove_dir: out of memory");
      break;
    }
    sprintf(p, "%s/%s", dir, nm);
    // Only plain files: a checkpoint directory holds no others, and a stray folder is not ours to delete.
    if (unlink(p) != 0 && errno != ENOENT) s = DLUA_ERR(DLUA_ERR_IO, "removing %s: %s", p, strerror(errno));
    free(p);
  }
  free(names);
  if (s == DLUA_OK && rmdir(dir) != 0 && errno != ENOENT)
    s = DLUA_ERR(DLUA_ERR_IO, "removing directory %s: %s", dir, strerror(errno));
  return s;
}

uint32_t dlua_crc32(uint32_t crc, const void *data, size_t n) {
  const unsigned char *p = data;
  uLong c = crc;
  while (n > 0) {
    uInt k = n > (1u << 30) ? (1u << 30) : (uInt)n;
    c = crc32(c, p, k);
    p += k;
    n -= k;
  }
  return (uint32_t)c;
}

dlua_status_t dlua_tensors_crc32(int64_t n, dlua_tensor_t *const *tensors, uint32_t *crc) {
  if (!crc || (n > 0 && !tensors)) return DLUA_ERR(DLUA_ERR_ARG, "crc32: NULL argument");
  uint32_t c = 0;
  for (int64_t i = 0; i < n; i++) {
    const dlua_tensor_t *t = tensors[i];
    if (!t || !t->storage) return DLUA_ERR(DLUA_ERR_ARG, "crc32: tensor %lld is NULL (freed?)", (long long)i + 1);
    size_t bytes = (size_t)dlua_tensor_numel(t) * dlua_dtype_size(t->dtype);
    if (bytes == 0) continue;
    if (t->device == DLUA_CPU && dlua_tensor_is_contiguous(t)) {
      c = dlua_crc32(c, dlua_tensor_ptr(t), bytes);
      continue;
    }
    void *buf = malloc(bytes);
    if (!buf) return DLUA_ERR(DLUA_ERR_OOM, "crc32: out of memory staging %zu bytes", bytes);
    dlua_status_t s = dlua_tensor_to_data(t, buf, bytes);
    if (s == DLUA_OK) c = dlua_crc32(c, buf, bytes);
    free(buf);
    DLUA_TRY(s);
  }
  *crc = c;
  return DLUA_OK;
}
