/* kvctl entry point (placeholder until the client lands). */
#include <stdio.h>
int main(void)
{
    puts("usage: kvctl [--help]");
    return 0;
}
