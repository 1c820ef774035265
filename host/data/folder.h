/* ImageFolder file lists: root/<class>/.../<image>, classes sorted, scanned once and cached in a file keyed by the root and its folders' mtimes. */
#ifndef DLUA_DATA_FOLDER_H
#define DLUA_DATA_FOLDER_H
#include <stdint.h>
#include "core/api.h"

struct dlua_folder {
  int refcount;          /* atomic: the Lua object and every loader that reads the list */
  char *root;            /* realpath of the root, no trailing slash */
  int nclasses;
  char **classes;        /* (nclasses) sorted folder names */
  int64_t n;
  char **paths;          /* (n) paths relative to root, sorted as torchvision's ImageFolder */
  int32_t *labels;       /* (n) 0-based class of each file */
  int from_cache;
  char *cache_path;      /* the list file used or written; NULL without a cache */
};

/* One more reference (a loader keeps the list alive while its threads read it). */
void dlua_folder_retain(dlua_folder_t *f);

/* root + "/" + paths[i] into buf (grown with realloc); returns the string or NULL on OOM. */
char *dlua_folder_full_path(const dlua_folder_t *f, int64_t i, char **buf, size_t *cap);

#endif
