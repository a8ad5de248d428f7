// heap_trace.py's allocation tracer, preloaded (LD_PRELOAD) into its ranks: once shim_enable(path)
// is called it writes every malloc / calloc / realloc / posix_memalign / memalign / aligned_alloc
// of MIN bytes or more, and the free of each, to path as records {u64 op (1 alloc, 2 free,
// 3 mark), u64 address, u64 size (a mark's number), u64 thread id}. glibc's own mtrace did not
// write from a Python process here (glibc 2.36, libc_malloc_debug.so preloaded).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/syscall.h>
#define MIN (64 * 1024)
#define HT (1 << 20)
static void *(*r_malloc)(size_t); static void (*r_free)(void *);
static void *(*r_calloc)(size_t, size_t); static void *(*r_realloc)(void *, size_t);
static int (*r_pm)(void **, size_t, size_t); static void *(*r_memalign)(size_t, size_t);
static void *(*r_aa)(size_t, size_t);
static volatile int lock_; static int enabled; static int fd = -1;
static uintptr_t ht[HT];
static uint64_t buf[4 * 4096]; static int nbuf;
static char tmpbuf[65536]; static size_t tmpused;
static void lk(void){ while(__sync_lock_test_and_set(&lock_,1)); }
static void ul(void){ __sync_lock_release(&lock_); }
static void flush(void){ if(fd>=0 && nbuf){ ssize_t w = write(fd, buf, nbuf*8); (void)w; } nbuf=0; }
static void rec(uint64_t op, uint64_t a, uint64_t s){
  if(nbuf + 4 > 4*4096) flush();
  buf[nbuf++]=op; buf[nbuf++]=a; buf[nbuf++]=s; buf[nbuf++]=(uint64_t)syscall(SYS_gettid);
}
static size_t h(uintptr_t p){ return (p >> 4) * 2654435761u & (HT-1); }
static void ins(uintptr_t p){ size_t i=h(p); while(ht[i] && ht[i]!=1) i=(i+1)&(HT-1); ht[i]=p; }
static int del(uintptr_t p){ size_t i=h(p); while(ht[i]){ if(ht[i]==p){ ht[i]=1; return 1;} i=(i+1)&(HT-1);} return 0; }
static void init(void){
  if(r_malloc) return;
  r_malloc=dlsym(RTLD_NEXT,"malloc"); r_free=dlsym(RTLD_NEXT,"free");
  r_calloc=dlsym(RTLD_NEXT,"calloc"); r_realloc=dlsym(RTLD_NEXT,"realloc");
  r_pm=dlsym(RTLD_NEXT,"posix_memalign"); r_memalign=dlsym(RTLD_NEXT,"memalign");
  r_aa=dlsym(RTLD_NEXT,"aligned_alloc");
}
static void after(void *p, size_t s){ if(p && enabled && s>=MIN){ lk(); ins((uintptr_t)p); rec(1,(uintptr_t)p,s); ul(); } }
void shim_enable(const char *path){ lk(); fd=open(path,O_WRONLY|O_CREAT|O_TRUNC,0644); enabled=1; ul(); }
void shim_mark(uint64_t k){ lk(); if(enabled) rec(3,0,k); ul(); }
void shim_disable(void){ lk(); enabled=0; flush(); close(fd); fd=-1; ul(); }
void *malloc(size_t s){ if(!r_malloc){ if(tmpused+s<sizeof tmpbuf){ void*p=tmpbuf+tmpused; tmpused+=(s+15)&~15; return p;} } init(); void*p=r_malloc(s); after(p,s); return p; }
void *calloc(size_t n, size_t s){ if(!r_calloc){ void*p=malloc(n*s); if(p) memset(p,0,n*s); return p;} void*p=r_calloc(n,s); after(p,n*s); return p; }
void free(void *p){ if(!p) return; if((char*)p>=tmpbuf && (char*)p<tmpbuf+sizeof tmpbuf) return; init();
  if(enabled){ lk(); if(del((uintptr_t)p)) rec(2,(uintptr_t)p,0); ul(); } r_free(p); }
void *realloc(void *o, size_t s){ init(); if(o && enabled){ lk(); if(del((uintptr_t)o)) rec(2,(uintptr_t)o,0); ul(); } void*p=r_realloc(o,s); after(p,s); return p; }
int posix_memalign(void **m, size_t a, size_t s){ init(); int r=r_pm(m,a,s); if(!r) after(*m,s); return r; }
void *memalign(size_t a, size_t s){ init(); void*p=r_memalign(a,s); after(p,s); return p; }
void *aligned_alloc(size_t a, size_t s){ init(); void*p=r_aa(a,s); after(p,s); return p; }
