/* libkvd (placeholder until the client library lands). */
int kvd_client_placeholder(void);
int kvd_client_placeholder(void)
{
    return 0;
}
