/* edgesplit broker plugin: a client id belongs to the account that logs in with it.
 *
 * Accepted client ids: "<username>" or "<username>:<anything>". A connection whose client id
 * names another account is refused at CONNECT, so no account can take over (and drop) another
 * account's connection or persistent session. The password check is left to password_file.
 */
#include <string.h>

#include <mosquitto.h>
#include <mosquitto_broker.h>
#include <mosquitto_plugin.h>

static mosquitto_plugin_id_t *plugin_id;

static int on_basic_auth(int event, void *event_data, void *userdata)
{
	struct mosquitto_evt_basic_auth *auth = event_data;
	const char *id = mosquitto_client_id(auth->client);
	const char *user = auth->username;
	size_t length;
	(void)event;
	(void)userdata;

	if(user == NULL || id == NULL){
		return MOSQ_ERR_PLUGIN_DEFER; /* anonymous: allow_anonymous decides */
	}
	length = strlen(user);
	if(strncmp(id, user, length) == 0 && (id[length] == '\0' || id[length] == ':')){
		return MOSQ_ERR_PLUGIN_DEFER; /* the id is the account's: the password file decides */
	}
	mosquitto_log_printf(MOSQ_LOG_NOTICE,
		"edgesplit: refused client id '%s' for account '%s' (ids are '<account>' or '<account>:...')",
		id, user);
	return MOSQ_ERR_AUTH;
}

int mosquitto_plugin_version(int supported_version_count, const int *supported_versions)
{
	for(int i = 0; i < supported_version_count; i++){
		if(supported_versions[i] == 5) return 5;
	}
	return -1;
}

int mosquitto_plugin_init(mosquitto_plugin_id_t *identifier, void **userdata,
		struct mosquitto_opt *options, int option_count)
{
	(void)userdata;
	(void)options;
	(void)option_count;
	plugin_id = identifier;
	return mosquitto_callback_register(plugin_id, MOSQ_EVT_BASIC_AUTH, on_basic_auth, NULL, NULL);
}

int mosquitto_plugin_cleanup(void *userdata, struct mosquitto_opt *options, int option_count)
{
	(void)userdata;
	(void)options;
	(void)option_count;
	return mosquitto_callback_unregister(plugin_id, MOSQ_EVT_BASIC_AUTH, on_basic_auth, NULL);
}
