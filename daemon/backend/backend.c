/* backend: the parts of the backend contract that do not depend on an
 * implementation: backend_free, and backend_cuda_new for builds without CUDA
 * (the real one lives in backend_cuda.c, built only with KVD_HAVE_CUDA). */
#include "backend.h"

#include "kvd/status.h"

void backend_free(struct backend *be)
{
    if (be && be->ops && be->ops->destroy)
        be->ops->destroy(be);
}

#ifndef KVD_HAVE_CUDA
int backend_cuda_new(int device, struct backend **out, struct kvd_error *err)
{
    *out = NULL;
    return kvd_error_set(err, KVD_EUNSUPPORTED,
                         "cuda backend unavailable: kvd was built without CUDA (rebuild with "
                         "-DKVD_CUDA=ON on a machine with nvcc), device %d not opened",
                         device);
}
#endif
