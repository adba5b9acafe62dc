/* tenant: tenant and namespace name tables (see tenant.h). Lookups are
 * linear scans: the tables hold the tenants live at once (removed slots are
 * reused), which the server bounds (max-sub-tenants per front end). */
#include "tenant.h"

#include <stdlib.h>
#include <string.h>

void tenant_table_free(struct tenant_table *tt)
{
    free(tt->v);
    free(tt->ns_names);
    free(tt->free_t);
    free(tt->free_ns);
    memset(tt, 0, sizeof *tt);
}

uint32_t tenant_find(const struct tenant_table *tt, const char *name)
{
    if (!name[0])
        return UINT32_MAX;
    for (uint32_t i = 0; i < tt->n; i++)
        if (strcmp(tt->v[i].conf.name, name) == 0)
            return i;
    return UINT32_MAX;
}

uint32_t tenant_ns_find(const struct tenant_table *tt, const char *name)
{
    if (!name[0])
        return UINT32_MAX;
    for (uint32_t i = 0; i < tt->n_ns; i++)
        if (strcmp(tt->ns_names[i], name) == 0)
            return i;
    return UINT32_MAX;
}

int tenant_add(struct tenant_table *tt, const struct kvmm_tenant_conf *conf, uint32_t *id)
{
    uint32_t i;

    if (tt->n_free_t) {
        i = tt->free_t[--tt->n_free_t];
    } else {
        struct tenant *v = realloc(tt->v, sizeof *v * (tt->n + 1));
        if (!v)
            return KVD_ENOMEM;
        tt->v = v;
        i = tt->n++;
    }
    memset(&tt->v[i], 0, sizeof tt->v[i]);
    tt->v[i].conf = *conf;
    tt->v[i].ns = UINT32_MAX;
    *id = i;
    return 0;
}

int tenant_add_at(struct tenant_table *tt, const struct kvmm_tenant_conf *conf, uint32_t id)
{
    if (id < tt->n) {
        uint32_t k = 0;
        if (tt->v[id].conf.name[0])
            return KVD_EBUSY;
        while (k < tt->n_free_t && tt->free_t[k] != id)
            k++;
        if (k == tt->n_free_t)
            return KVD_EBUSY;
        tt->free_t[k] = tt->free_t[--tt->n_free_t];
    } else {
        struct tenant *v = realloc(tt->v, sizeof *v * ((size_t)id + 1));
        if (!v)
            return KVD_ENOMEM;
        tt->v = v;
        if (id > tt->n) { /* the slots between: removed ones */
            uint32_t need = tt->n_free_t + (id - tt->n);
            if (need > tt->cap_free_t) {
                uint32_t *f = realloc(tt->free_t, sizeof *f * need);
                if (!f)
                    return KVD_ENOMEM;
                tt->free_t = f;
                tt->cap_free_t = need;
            }
            for (uint32_t i = tt->n; i < id; i++) {
                memset(&tt->v[i], 0, sizeof tt->v[i]);
                tt->v[i].ns = UINT32_MAX;
                tt->free_t[tt->n_free_t++] = i;
            }
        }
        tt->n = id + 1;
    }
    memset(&tt->v[id], 0, sizeof tt->v[id]);
    tt->v[id].conf = *conf;
    tt->v[id].ns = UINT32_MAX;
    return 0;
}

int tenant_ns_add(struct tenant_table *tt, const char *name, uint32_t *id, bool *reused)
{
    uint32_t i;
    bool again = tt->n_free_ns > 0;

    if (again) {
        i = tt->free_ns[--tt->n_free_ns];
    } else {
        char(*v)[80] = realloc(tt->ns_names, sizeof *v * (tt->n_ns + 1));
        if (!v)
            return KVD_ENOMEM;
        tt->ns_names = v;
        i = tt->n_ns++;
    }
    memset(tt->ns_names[i], 0, sizeof tt->ns_names[i]);
    strncpy(tt->ns_names[i], name, sizeof tt->ns_names[i] - 1);
    *id = i;
    if (reused)
        *reused = again;
    return 0;
}

/* Appends id to a free list of capacity *cap. */
static int free_push(uint32_t **v, uint32_t *n, uint32_t *cap, uint32_t id)
{
    if (*n == *cap) {
        uint32_t nc = *cap ? *cap * 2 : 16;
        uint32_t *nv = realloc(*v, sizeof *nv * nc);
        if (!nv)
            return KVD_ENOMEM;
        *v = nv;
        *cap = nc;
    }
    (*v)[(*n)++] = id;
    return 0;
}

int tenant_remove(struct tenant_table *tt, uint32_t id)
{
    int rc = free_push(&tt->free_t, &tt->n_free_t, &tt->cap_free_t, id);
    if (rc == 0) {
        memset(&tt->v[id], 0, sizeof tt->v[id]);
        tt->v[id].ns = UINT32_MAX;
    }
    return rc;
}

int tenant_ns_remove(struct tenant_table *tt, uint32_t id)
{
    int rc = free_push(&tt->free_ns, &tt->n_free_ns, &tt->cap_free_ns, id);
    if (rc == 0)
        memset(tt->ns_names[id], 0, sizeof tt->ns_names[id]);
    return rc;
}
